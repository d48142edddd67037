"""Named remat policies: what each keeps for the backward pass, and the memory that costs."""

import contextlib
import io
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from kiln.config import MESH_AXES, config_from_dict
from kiln.config.schema import ModelConfig
from kiln.model.llama import REMAT_POLICIES, TAGS, Block, Transformer
from kiln.training import train
from kiln.training.batches import place_batch

# The schema lists the policies most memory first (as docs/performance.md does); offload's
# place depends on whether the platform has a separate host memory, so it is checked apart.
ORDER = typing.get_args(ModelConfig.model_fields["remat"].annotation)
B, S, V = 8, 64, 128


def config(remat, *, layers=2, seq=S, d_ff=256):
    model = dict(
        vocab_size=V, d_model=64, num_layers=layers, num_heads=4, num_kv_heads=2, d_ff=d_ff
    )
    return config_from_dict(
        {
            "model": {**model, "max_seq_len": seq, "remat": remat},
            "mesh": {"data": 1, "fsdp": 1, "tensor": 1, "sequence": 1},
            "data": {"seq_len": seq},
            "train": {"global_batch_size": B},
        }
    )


def test_the_schema_offers_exactly_the_implemented_policies():
    assert set(ORDER) == {"none", *REMAT_POLICIES}
    assert ORDER[0] == "none" and ORDER[-1] == "full"


def saved(policy) -> list[str]:
    """What one block keeps for its backward under `policy`, besides its arguments."""
    cfg = config("none", seq=8, d_ff=48).model
    graphdef, state = nnx.split(Block(cfg, rngs=nnx.Rngs(0)))
    positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
    segments = jnp.ones((2, 8), jnp.int32)

    def block(state, x):
        return nnx.merge(graphdef, state)(x, positions, segments)

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        f = jax.checkpoint(block, policy=policy, prevent_cse=False)
        print_saved_residuals(f, state, jnp.ones((2, 8, 64)))
    # "f32[2,8,4,16] named 'q_proj' from ..." -> "f32[2,8,4,16] named 'q_proj'"; the block's
    # arguments and the positions and segment ids (closed over) are kept by every policy.
    lines = [line for line in out.getvalue().splitlines() if " from the argument " not in line]
    return [line.split(" from ")[0] for line in lines if not line.startswith("i32[2,8]")]


Q, KV, D, F = "f32[2,8,4,16]", "f32[2,8,2,16]", "f32[2,8,64]", "f32[2,8,48]"


def test_each_policy_keeps_exactly_what_it_documents():
    dots = [f"{Q} output of dot_general", *[f"{KV} output of dot_general"] * 2]
    dots += [f"{D} output of dot_general", *[f"{F} output of dot_general"] * 2]
    qkv = [f"{Q} named 'q_proj'", f"{KV} named 'k_proj'", f"{KV} named 'v_proj'"]
    want = {
        # The projections q, k, v, wo, gate, up; not attention's batched score/value matmuls.
        "save_dots": dots,
        # The same six by name (the down projection's output is named, but nothing needs it).
        "save_projections": [
            *qkv,
            f"{D} named 'out_proj'",
            f"{F} named 'mlp_gate'",
            f"{F} named 'mlp_up'",
        ],
        "minimal": [*qkv, f"{Q} named 'attn_out'", f"{D} named 'out_proj'"],
        "save_qkv_proj": qkv,
        "save_out_proj": [f"{D} named 'out_proj'"],
        # save_dots' six tensors, in host memory.
        "offload": [
            s.replace("f32", "f32<host>").replace("dot_general", "device_put") for s in dots
        ],
        "full": [],
    }
    assert set(want) == set(REMAT_POLICIES)
    for name, policy in REMAT_POLICIES.items():
        assert saved(policy) == want[name], name


def test_every_tag_is_in_the_block():
    cfg = config("none", seq=8, d_ff=48).model
    graphdef, state = nnx.split(Block(cfg, rngs=nnx.Rngs(0)))
    x = jnp.ones((2, 8, 64))
    args = (x, jnp.broadcast_to(jnp.arange(8), (2, 8)), jnp.ones((2, 8), jnp.int32))
    jaxpr = jax.make_jaxpr(lambda state: nnx.merge(graphdef, state)(*args))(state)
    names = [e.params["name"] for e in jaxpr.jaxpr.eqns if e.primitive.name == "name"]
    assert sorted(names) == sorted(TAGS)


def temp_bytes(remat: str, state, mesh) -> tuple[int, int]:
    """(device, host) temporary bytes of the compiled train step, as XLA reports them."""
    cfg = config(remat, layers=LAYERS)
    # The model's settings (remat among them) travel in the state's graphdef.
    model = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)))
    state = state.replace(graphdef=nnx.split(model, nnx.Param, ...)[0])
    step = train.make_train_step(cfg, mesh, train.shardings_of(state))
    tokens = np.zeros((B, S), np.int32)
    batch = {
        "inputs": tokens,
        "targets": tokens,
        "positions": np.broadcast_to(np.arange(S, dtype=np.int32), (B, S)),
        "segment_ids": np.ones((B, S), np.int32),
        "weights": np.ones((B, S), np.float32),
    }
    stats = step.lower(state, place_batch(batch, mesh, cfg)).compile().memory_analysis()
    return stats.temp_size_in_bytes, stats.host_temp_size_in_bytes


# The kept activations (which grow with depth) outweigh the one block's recomputation peak,
# which XLA's scheduler shapes differently per policy (at 4 layers neighbours can swap).
LAYERS = 16


@pytest.mark.slow
def test_policies_are_ordered_by_compiled_temporary_memory():
    mesh = jax.make_mesh(
        (1,) * len(MESH_AXES),
        MESH_AXES,
        axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES),
        devices=jax.devices()[:1],
    )
    # The state as sharded shapes (nothing to initialise for a compile), the same for every policy.
    cfg = config("none", layers=LAYERS)
    _, state = train.abstract_pretraining(cfg, mesh)
    temp = {remat: temp_bytes(remat, state, mesh) for remat in ORDER}
    # save_projections keeps save_dots' tensors, chosen by name: the same memory.
    assert temp["save_projections"] == temp["save_dots"], temp
    device = [temp[r][0] for r in ORDER if r not in ("offload", "save_projections")]
    assert device == sorted(device, reverse=True) and len(set(device)) == len(device), temp
    # CPU has a pinned_host memory kind, but its device_put lowering ignores memory kinds:
    # offloaded tensors stay in the same RAM, exactly as save_dots keeps them.
    assert jax.default_backend() == "cpu"
    assert temp["offload"] == temp["save_dots"], temp
