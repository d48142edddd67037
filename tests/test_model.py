"""The Transformer against a float64 numpy reference, across meshes, and its size accounting."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from conftest import kiln_main
from kiln.config import MESH_AXES, config_from_dict, load_config
from kiln.errors import KilnError
from kiln.model import (
    FAMILIES,
    ModelOutput,
    abstract_model,
    create_model,
    flops_per_token,
    state_bytes_per_device,
    state_size,
    summary,
)
from kiln.model.attention import dense_attention as attention
from kiln.model.llama import REMAT_POLICIES, Transformer
from kiln.model.project import project
from kiln.parallel.mesh import (
    batch_sharding,
    grad_reduce_dtype,
    make_mesh,
    sharded_abstract,
    state_shardings,
    use_mesh,
)
from kiln.training import train
from kiln.training.batches import place_batch
from kiln.training.optim import make_optimizer, state_name

ROOT = Path(__file__).resolve().parents[1]
B, S, V = 8, 16, 128
TINY = dict(vocab_size=V, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=64)
# The tied variant also switches on qk_norm and the logit cap, so both are covered sharded.
VARIANTS = {
    "untied": dict(tie_embeddings=False),
    "tied": dict(tie_embeddings=True, qk_norm=True, logit_softcap=3.0),
}
MESHES = {
    "fsdp8": dict(fsdp=8),
    "data2_fsdp2_tensor2": dict(data=2, fsdp=2, tensor=2),
    "data4_tensor2": dict(data=4, fsdp=1, tensor=2),
    "sequence2_fsdp4": dict(fsdp=4, sequence=2),
}


def make_config(model=None, mesh=None, optim=None):
    return config_from_dict(
        {
            "model": {**TINY, "max_seq_len": 32, **(model or {})},
            "mesh": {"data": 1, "fsdp": 1, "tensor": 1, "sequence": 1, **(mesh or {})},
            "data": {"seq_len": S},
            "train": {"global_batch_size": B},
            "optim": optim or {},
        }
    )


def packed_batch(seed=0):
    """[B, S] tokens, positions and segment ids: two documents per row, some rows padded."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, (B, S))
    positions = np.zeros((B, S), np.int32)
    segments = np.zeros((B, S), np.int32)
    for b in range(B):
        cut, end = rng.integers(2, S - 4), S - (b % 3) * 2
        positions[b, :cut], segments[b, :cut] = np.arange(cut), 1
        positions[b, cut:end], segments[b, cut:end] = np.arange(end - cut), 2
    return jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments)


def forward(model, tokens, positions, segments, mesh=None, rules=None):
    """Logits through the trainer's path: split, jit with explicit shardings, merge inside."""
    graphdef, state = nnx.split(model)

    def fn(state, tokens, positions, segments):
        m = nnx.merge(graphdef, state)
        return m.logits(m.hidden_states(tokens, positions, segments).hidden)

    if mesh is None:
        return jax.jit(fn)(state, tokens, positions, segments)
    batch = batch_sharding(mesh, rules)
    shardings = (state_shardings(state, mesh, rules), batch, batch, batch)
    with use_mesh(mesh, rules):
        return jax.jit(fn, in_shardings=shardings)(state, tokens, positions, segments)


def rebuild(model, model_cfg):
    """`model`'s parameters under another static setup (dtype, remat), without re-init."""
    graphdef, _ = nnx.split(abstract_model(model_cfg))
    return nnx.merge(graphdef, nnx.state(model))


def rel_err(a, b):
    """max |a - b| / max |b|: a relative error that near-zero entries cannot blow up."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / np.abs(b).max()


# ---------------------------------------------------------------------------------------------
# Independent float64 numpy reference of the same architecture.


def _rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _rope(x_SNH, pos_S, theta):
    half = x_SNH.shape[-1] // 2
    angle = pos_S[:, None, None] * theta ** (-np.arange(half) / half)
    x1, x2 = x_SNH[..., :half], x_SNH[..., half:]
    return np.concatenate(
        [x1 * np.cos(angle) - x2 * np.sin(angle), x2 * np.cos(angle) + x1 * np.sin(angle)], -1
    )


def reference(model, tokens_S, pos_S, seg_S):
    """(logits [S, V], residual after each block [L, S, D]) for one row, in float64."""
    cfg = model.cfg
    p = jax.tree.map(lambda v: np.asarray(v, np.float64), nnx.to_pure_dict(nnx.state(model)))
    eps, group = cfg.norm_eps, cfg.num_heads // cfg.kv_heads
    x = p["embedding"][np.asarray(tokens_S)]
    pos_S, seg_S = np.asarray(pos_S, np.float64), np.asarray(seg_S)
    s = len(tokens_S)
    allowed = (seg_S[:, None] == seg_S[None, :]) & np.tri(s, dtype=bool)
    # A sliding_attention layer: the query at row i sees rows i-W+1..i (of its document).
    in_window = np.subtract.outer(np.arange(s), np.arange(s)) < (cfg.sliding_window or s)
    feats = []
    for i, local in enumerate(cfg.local_layers()):
        blk = jax.tree.map(lambda a, i=i: a[i], p["blocks"])
        a = blk["attn"]
        h = _rms(x, blk["attn_norm"]["scale"], eps)
        q = np.einsum("sd,dnh->snh", h, a["wq"])
        k = np.einsum("sd,dkh->skh", h, a["wk"])
        v = np.einsum("sd,dkh->skh", h, a["wv"])
        if cfg.qk_norm:
            q, k = _rms(q, a["q_norm"]["scale"], eps), _rms(k, a["k_norm"]["scale"], eps)
        theta = cfg.local_rope_theta if local and cfg.local_rope_theta else cfg.rope_theta
        q, k = _rope(q, pos_S, theta), _rope(k, pos_S, theta)
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # head n -> kv n // G
        scores = np.einsum("snh,tnh->nst", q, k) / np.sqrt(q.shape[-1])
        scores = np.where((allowed & (in_window | (not local)))[None], scores, -np.inf)
        # Sinks: one more logit per head in every row's softmax, with no value.
        sink = a["sinks"][:, None] if cfg.attention_sinks else np.full((q.shape[1], 1), -np.inf)
        top = np.maximum(scores.max(-1), sink)
        probs = np.exp(scores - top[..., None])
        probs /= (probs.sum(-1) + np.exp(sink - top))[..., None]
        x = x + np.einsum("snh,nhd->sd", np.einsum("nst,tnh->snh", probs, v), a["wo"])
        h = _rms(x, blk["mlp_norm"]["scale"], eps)
        m = blk["mlp"]
        gate = h @ m["w_gate"]
        x = x + (gate / (1 + np.exp(-gate)) * (h @ m["w_up"])) @ m["w_down"]
        feats.append(x)
    hidden = _rms(x, p["final_norm"]["scale"], eps)
    logits = hidden @ (p["embedding"].T if cfg.tie_embeddings else p["lm_head"])
    if cfg.logit_softcap:
        logits = cfg.logit_softcap * np.tanh(logits / cfg.logit_softcap)
    return logits, np.stack(feats)


# ---------------------------------------------------------------------------------------------
# Shared fixtures: each model is built and compiled once per module.


@pytest.fixture(scope="module")
def batch():
    return packed_batch()


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request):
    return request.param


@pytest.fixture(scope="module")
def unsharded(batch):
    """Per variant: (model, logits) on one device with no mesh."""
    out = {}
    for name, overrides in VARIANTS.items():
        model = create_model(make_config(overrides), None, seed=0)
        out[name] = (model, forward(model, *batch))
    return out


@pytest.fixture(scope="module")
def fsdp8_model():
    config = make_config(VARIANTS["untied"], MESHES["fsdp8"])
    mesh = make_mesh(config)
    return create_model(config, mesh, seed=0), mesh, config


def test_matches_numpy_reference(unsharded, batch, variant):
    model, logits = unsharded[variant]
    tokens, positions, segments = batch
    for b in (0, 1, 5):
        want, _ = reference(model, tokens[b], positions[b], segments[b])
        # 1e-5: float32 (matmul precision "highest") vs float64 over two small blocks.
        assert rel_err(logits[b], want) < 1e-5


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_sharded_equals_unsharded(unsharded, batch, variant, mesh_name):
    config = make_config(VARIANTS[variant], MESHES[mesh_name])
    mesh = make_mesh(config)
    # Same parameters placed by the rules (create_model's sharded init is checked below); the
    # model itself holds no mesh, so the very same module runs sharded inside use_mesh.
    model = unsharded[variant][0]
    logits = forward(model, *batch, mesh=mesh, rules=config.mesh.rules)
    # 1e-5 relative (float32): only the order of sharded reductions differs.
    assert rel_err(logits, unsharded[variant][1]) < 1e-5


def test_sharded_init_equals_unsharded_init(fsdp8_model, unsharded):
    model, _, _ = fsdp8_model
    got, want = nnx.state(model, nnx.Param), nnx.state(unsharded["untied"][0], nnx.Param)
    # Bitwise: threefry random bits do not depend on how the output is partitioned.
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(g, w)


def test_parameters_are_sharded_by_the_rules(fsdp8_model):
    model, _, _ = fsdp8_model
    # The default rules written out: embed -> fsdp, sequence, expert; vocab, heads, kv_heads,
    # mlp -> tensor.
    E = ("fsdp", "sequence", "expert")
    expected = {
        "embedding": P("tensor", E),
        "lm_head": P(E, "tensor"),
        "final_norm/scale": P(None),
        "blocks/attn_norm/scale": P(None, None),
        "blocks/mlp_norm/scale": P(None, None),
        "blocks/attn/wq": P(None, E, "tensor", None),
        "blocks/attn/wk": P(None, E, "tensor", None),
        "blocks/attn/wv": P(None, E, "tensor", None),
        "blocks/attn/wo": P(None, "tensor", None, E),
        "blocks/mlp/w_gate": P(None, E, "tensor"),
        "blocks/mlp/w_up": P(None, E, "tensor"),
        "blocks/mlp/w_down": P(None, "tensor", E),
    }
    flat = {
        "/".join(str(k) for k in path): v
        for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }
    assert set(flat) == set(expected)
    for name, var in flat.items():
        array = var.get_value()
        assert array.sharding.spec == expected[name], name
        if "fsdp" in expected[name]:
            # With fsdp=8 every device holds 1/8 of the matrix, never the whole of it.
            dim = tuple(expected[name]).index("fsdp")
            for shard in array.addressable_shards:
                assert shard.data.shape[dim] == array.shape[dim] // 8, name
    assert model.final_norm.scale.get_value().shape == (TINY["d_model"],)


def test_sharding_rules_come_from_the_config():
    config = config_from_dict(
        {
            "model": {**TINY, "max_seq_len": 32},
            "mesh": {"fsdp": 8, "rules": {"embed": [], "vocab": ["fsdp"]}},
            "data": {"seq_len": S},
        }
    )
    _, state = sharded_abstract(
        lambda: Transformer(config.model, rngs=nnx.Rngs(0)), make_mesh(config), config.mesh.rules
    )
    assert state["embedding"].get_value().sharding.spec == P("fsdp", None)
    assert state["blocks"]["attn"]["wq"].get_value().sharding.spec == P(None, None, "tensor", None)


def _hidden_jacobian(model, tokens, positions, segments):
    """d hidden[t] . r / d embedding: [S, V, D] for one row (tokens distinct, so row = position)."""
    graphdef, table, rest = nnx.split(model, nnx.PathContains("embedding"), ...)
    r = jax.random.normal(jax.random.key(1), (TINY["d_model"],))

    def hidden_dot_r(table):
        m = nnx.merge(graphdef, table, rest)
        return m.hidden_states(tokens[None], positions[None], segments[None]).hidden[0] @ r

    (jac,) = jax.tree.leaves(jax.jit(jax.jacrev(hidden_dot_r))(table))
    return np.asarray(jac)


def test_causal_and_no_gradient_across_documents(unsharded):
    model = unsharded["untied"][0]
    tokens = jnp.asarray(np.random.default_rng(3).permutation(V)[:S])
    positions = jnp.concatenate([jnp.arange(6), jnp.arange(S - 6)])
    segments = jnp.asarray([1] * 6 + [2] * (S - 6))
    jac = _hidden_jacobian(model, tokens, positions, segments)
    jac_ts = np.abs(jac[:, np.asarray(tokens)]).sum(-1)  # [t, s]: |d out_t / d token_s|
    t, s = np.indices((S, S))
    visible = (s <= t) & (np.asarray(segments)[t] == np.asarray(segments)[s])
    # Exactly zero: masked scores become exp(-huge) == 0.0, so nothing leaks in float32.
    assert np.all(jac_ts[~visible] == 0.0)
    assert np.all(jac_ts[visible] > 0.0)


def run(model, tokens, positions, segments, collect=()):
    """model.hidden_states(...) under jit, as the trainer calls it."""
    graphdef, state = nnx.split(model)

    def fn(state, tokens, positions, segments):
        m = nnx.merge(graphdef, state)
        return m.hidden_states(tokens, positions, segments, collect=collect)

    return jax.jit(fn)(state, tokens, positions, segments)


def test_document_packed_at_offset_equals_document_alone(unsharded):
    model = unsharded["untied"][0]
    rng = np.random.default_rng(4)
    doc, other, k, pad = rng.integers(0, V, 8), rng.integers(0, V, 5), 5, np.zeros(S, int)
    alone = np.concatenate([doc, pad[: S - 8]]), np.r_[0:8, 0 : S - 8], [1] * 8 + [0] * (S - 8)
    packed = (
        np.concatenate([other, doc, pad[: S - 8 - k]]),
        np.r_[0:k, 0:8, 0 : S - 8 - k],
        [1] * k + [2] * 8 + [0] * (S - 8 - k),
    )
    hidden = run(model, *(jnp.asarray(np.stack([x, y])) for x, y in zip(alone, packed))).hidden
    # 1e-6 relative: identical inputs per token; only summation order over masked keys differs.
    assert rel_err(hidden[1, k : k + 8], hidden[0, :8]) < 1e-6


def test_collect_returns_the_residual_stream(unsharded, batch):
    model, logits = unsharded["untied"]
    tokens, positions, segments = batch
    out = run(model, tokens, positions, segments)
    assert isinstance(out, ModelOutput) and out.features is None and out.aux == {}
    out = run(model, tokens, positions, segments, collect=(1, 0))
    hidden, feats, aux = out.hidden, out.features, out.aux
    assert aux == {} and out.ahead == ()
    assert feats.shape == (2, B, S, TINY["d_model"])
    _, want = reference(model, tokens[2], positions[2], segments[2])
    # 1e-5 relative: float32 vs float64 reference, as above.
    assert rel_err(feats[0, 2], want[1]) < 1e-5
    assert rel_err(feats[1, 2], want[0]) < 1e-5
    # 1e-6 relative: the same float32 computation as the plain call, compiled separately.
    assert rel_err(model.logits(hidden), logits) < 1e-6


def test_blocked_attention_equals_whole_attention_also_sequence_sharded(batch):
    _, _, segments = batch
    kq, kk, kv, kg = jax.random.split(jax.random.key(2), 4)
    q = jax.random.normal(kq, (B, S, 4, 8))
    k, v = jax.random.normal(kk, (B, S, 2, 8)), jax.random.normal(kv, (B, S, 2, 8))
    cot = jax.random.normal(kg, (B, S, 4, 8))

    def value_and_grads(query_block):
        def f(q, k, v):
            return jnp.sum(attention(q, k, v, segments, query_block=query_block) * cot)

        return jax.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)

    whole = jax.jit(value_and_grads, static_argnums=0)(S)
    config = make_config(mesh=MESHES["sequence2_fsdp4"])
    mesh = make_mesh(config)
    seq = jax.sharding.NamedSharding(mesh, P(("data", "fsdp", "expert"), "sequence"))
    q, k, v, cot, segments = (jax.device_put(x, seq) for x in (q, k, v, cot, segments))
    blocked = jax.jit(value_and_grads, static_argnums=0)(4)  # 4 strided blocks of 4 rows
    # 1e-6 relative: each row's softmax is the same float32 computation in either layout.
    for got, want in zip(jax.tree.leaves(blocked), jax.tree.leaves(whole)):
        assert rel_err(got, want) < 1e-6


def test_bf16_compute_with_f32_params_stays_close_to_f32(unsharded, batch):
    f32_model, f32_logits = unsharded["untied"]
    model = rebuild(f32_model, f32_model.cfg.model_copy(update={"dtype": "bfloat16"}))
    assert model.blocks.attn.wq.get_value().dtype == jnp.float32
    assert jax.eval_shape(lambda: model.hidden_states(*batch).hidden).dtype == jnp.bfloat16
    logits = forward(model, *batch)
    assert logits.dtype == jnp.float32
    # bf16 keeps 8 significant bits (unit roundoff 2^-9 ~ 2e-3). Each of the ~10 roundings per
    # block (inputs of every matmul, residual adds) adds up to 2e-3 relative error; over two
    # blocks and the head they accumulate to roughly 10x the unit roundoff: bound at 2e-2.
    assert rel_err(logits, f32_logits) < 2e-2


def test_the_family_picks_the_implementation(unsharded):
    config = make_config()
    assert config.model.family == "llama" and FAMILIES["llama"].model is Transformer
    assert type(unsharded["untied"][0]) is Transformer  # create_model went through the registry
    with pytest.raises(KilnError, match=r"model\.family: got 'gpt'; allowed: llama, moe"):
        make_config({"family": "gpt"})


def test_head_weight_is_cast_to_the_logits_dtype(unsharded):
    f32_model = unsharded["untied"][0]
    lm_head = np.asarray(f32_model.lm_head.get_value())
    cases = [
        ({"dtype": "bfloat16"}, jnp.bfloat16),  # default: the compute dtype
        ({"dtype": "bfloat16", "logits_dtype": "float32"}, jnp.float32),  # opt out
        ({"dtype": "float32", "logits_dtype": "bfloat16"}, jnp.bfloat16),
    ]
    for update, dtype in cases:
        model = rebuild(f32_model, f32_model.cfg.model_copy(update=update))
        assert model.head_weight().dtype == dtype, update
        np.testing.assert_array_equal(model.head_weight(), lm_head.astype(dtype))
        np.testing.assert_array_equal(model.head_weight(jnp.float32), lm_head)
    tied = unsharded["tied"][0]
    embedding = np.asarray(tied.embedding.get_value())
    np.testing.assert_array_equal(tied.head_weight(), embedding.T)


def test_diagnostics_are_the_head_norm_and_the_final_norm_scale(unsharded):
    for name, (model, _) in unsharded.items():
        p = jax.tree.map(lambda v: np.asarray(v, np.float64), nnx.to_pure_dict(nnx.state(model)))
        head = p["embedding"].T if name == "tied" else p["lm_head"]
        got = jax.jit(lambda m: m.diagnostics())(model)
        assert set(got) == {"learning/lm_head_norm", "learning/final_norm_scale"}
        assert all(v.dtype == jnp.float32 for v in got.values())
        # 1e-6 relative: float32 sums of squares of 4096-8192 entries vs float64.
        np.testing.assert_allclose(got["learning/lm_head_norm"], np.sqrt((head**2).sum()), 1e-6)
        np.testing.assert_allclose(
            got["learning/final_norm_scale"], p["final_norm"]["scale"].mean(), 1e-6
        )


# --- the LM head in the compute dtype ------------------------------------------------------------

# A base.yaml-like model (bf16 compute, f32 parameters, remat) with a vocabulary no other
# dimension of the step has, so every product on the head can be recognised by its shape.
HEAD_V = 256
BF16 = dict(dtype="bfloat16", param_dtype="float32", remat="save_dots", vocab_size=HEAD_V)


def lm_batch(seed=0):
    tokens, positions, segments = packed_batch(seed)
    targets = jnp.asarray(np.random.default_rng(seed + 1).integers(0, HEAD_V, (B, S)))
    weights = (segments > 0).astype(jnp.float32)
    return {
        "inputs": tokens,
        "targets": targets,
        "positions": positions,
        "segment_ids": segments,
        "weights": weights,
    }


def bf16_config(num_vocab_tiling=1, **model):
    raw = make_config({**BF16, **model}).model_dump()
    raw["loss"].update(z_loss_multiplier=1e-4, num_vocab_tiling=num_vocab_tiling)
    return config_from_dict(raw)


def one_device_mesh():
    """The config's 1x1x1x1 mesh on the first device (the dtypes do not depend on sharding)."""
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return jax.make_mesh(
        (1,) * len(MESH_AXES), MESH_AXES, axis_types=auto, devices=jax.devices()[:1]
    )


def _dot_generals(jaxpr):
    """Every dot_general of a jaxpr, inside scans, conds, remat, custom VJPs and sub-jits too."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _dot_generals(inner)


def head_products(config):
    """(input dtypes, output dtype) of each dot_general on the head in one traced train step."""
    mesh = one_device_mesh()
    state = train.init_state(config, mesh)
    step = train.make_train_step(config, mesh, train.shardings_of(state))
    batch = place_batch(lm_batch(), mesh, config)
    closed = step.trace(state, batch).jaxpr
    out = []
    for eqn in _dot_generals(closed.jaxpr):
        shapes = [v.aval.shape for v in (*eqn.invars, *eqn.outvars)]
        if any(HEAD_V in shape for shape in shapes):
            out.append(
                (tuple(str(v.aval.dtype) for v in eqn.invars), str(eqn.outvars[0].aval.dtype))
            )
    return out


@pytest.mark.parametrize("num_vocab_tiling", [1, 2], ids=["untiled", "tiled"])
def test_bf16_train_step_has_no_float32_matmul_on_the_head(num_vocab_tiling):
    products = head_products(bf16_config(num_vocab_tiling))
    # Forward logits, d hidden and d head: at least those three, each bf16 x bf16 -> f32.
    assert len(products) >= 3, products
    assert all(p == (("bfloat16", "bfloat16"), "float32") for p in products), products
    # The opt-out keeps them all in float32 (so the check above can see a float32 product).
    products = head_products(bf16_config(num_vocab_tiling, logits_dtype="float32"))
    assert len(products) >= 3 and all(p[0] == ("float32", "float32") for p in products), products


def test_bf16_head_loss_equals_the_float32_head_loss():
    batch = lm_batch()

    def loss_and_grad_norm(config):
        state = train.init_state(config, one_device_mesh())
        loss, _, grads = train.loss_and_grads(config, state, batch)
        return float(loss), float(
            np.sqrt(sum((np.asarray(g) ** 2).sum() for g in jax.tree.leaves(grads)))
        )

    got, got_norm = loss_and_grad_norm(bf16_config())
    want, want_norm = loss_and_grad_norm(bf16_config(logits_dtype="float32"))
    # The hidden states are bf16 in both; only the head's entries are rounded to bf16
    # (relative error <= 2^-9 each), so each logit moves by at most 2^-9 sum_d |h_d w_dv|
    # (~0.5 here: |h| ~ 1 after the norm, |w| ~ 0.02, D = 32), i.e. <= 1e-3, and the mean
    # loss (~log 256 = 5.5) by at most as much: 1e-3 / 5.5 < 2e-4 relative. The backward
    # products round the logit gradients and the head to bf16 too (2^-9 each), so each term
    # of every gradient moves by <= 2 * 2^-9 < 4e-3 relative, and so does the gradient norm.
    assert abs(got - want) / want < 2e-4
    assert abs(got_norm - want_norm) / want_norm < 4e-3


def test_remat_policies_give_the_same_gradients(unsharded, batch):
    base_model = unsharded["untied"][0]
    names = ["none", *REMAT_POLICIES]  # every policy, offload included (runnable on CPU)
    graphdefs = {
        r: nnx.split(abstract_model(base_model.cfg.model_copy(update={"remat": r})))[0]
        for r in names
    }

    def loss(state, graphdef):
        m = nnx.merge(graphdef, state)
        return jnp.mean(m.logits(m.hidden_states(*batch).hidden) ** 2)

    # One program holding every policy's gradient, not one compile per policy.
    every = jax.jit(
        lambda state: {r: jax.tree.leaves(jax.grad(loss)(state, graphdefs[r])) for r in names}
    )(nnx.state(base_model))
    for remat in REMAT_POLICIES:
        for g, want in zip(every[remat], every["none"], strict=True):
            # 1e-6 relative: recomputation repeats the same float32 ops.
            assert rel_err(g, want) < 1e-6, remat


def test_layers_are_scanned_so_the_program_does_not_grow_with_depth(batch):
    def num_equations(layers):
        config = make_config({"num_layers": layers})
        model = nnx.eval_shape(lambda: Transformer(config.model, rngs=nnx.Rngs(0)))
        graphdef, state = nnx.split(model)

        def fn(state):
            m = nnx.merge(graphdef, state)
            return m.hidden_states(*batch).hidden

        return len(jax.make_jaxpr(fn)(state).jaxpr.eqns)

    assert num_equations(2) == num_equations(6)


def test_llama3_8b_parameter_count_without_allocating():
    config = load_config(ROOT / "configs/models/llama3-8b.yaml")
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    want = 2 * 128256 * 4096 + 32 * per_layer + 4096
    n, _, _ = state_size(config, config.mesh.sizes(8))  # the count `kiln config --summary` prints
    assert n == want
    assert abs(n - 8.03e9) / 8.03e9 < 1e-3  # Meta's published 8.03B
    assert all(a.size < 10**6 for a in jax.live_arrays())  # nothing model-sized was created


def test_flops_per_token_follows_maxtext_accounting():
    config = load_config(ROOT / "configs/models/llama3-8b.yaml")
    seq, d, f, n, k, h, layers, vocab = 8192, 4096, 14336, 32, 8, 128, 32, 128256
    # MaxText calculate_tflops_training_per_device with per_device_batch_size=1, per token.
    ffn = 2 * seq * f * d * 2 + 2 * seq * f * d
    qkv = 2 * seq * d * (n + 2 * k) * h
    projection = 2 * seq * d * n * h
    causal_attention = 4 * seq**2 * n * h / 2
    learnable = ((ffn + qkv + projection) * layers + 2 * seq * d * vocab) * 3
    want = (learnable + causal_attention * layers * 3) / seq
    # 1e-12 relative: the same integers summed in a different order.
    assert abs(flops_per_token(config.model, seq) - want) / want < 1e-12


@pytest.mark.parametrize("family", ["llama", "moe"])
def test_summary_reports_the_decode_cache_init_cache_allocates(family):
    """The summary's bytes per token are what one more slot of `init_cache` holds, but its
    segment id (int32): the cache that `kiln generate` fills."""
    from kiln.model import abstract_model

    model_cfg = {**VARIANTS["untied"], "family": family, "dtype": "bfloat16"}
    config = make_config(model_cfg, MESHES["fsdp8"])
    model = abstract_model(config.model)

    def held(slots):
        cache = jax.eval_shape(lambda: model.init_cache(1, slots))
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))

    per_token, what = model.cache_bytes_per_token()
    assert per_token == held(2) - held(1) - 4  # one slot: keys, values and an int32 segment id
    text = summary(config, make_optimizer(config.optim).init, state_name(config.optim))
    assert f"decode cache:      {per_token:,} bytes per token (kiln generate: {what})" in text


def test_summary_memory_matches_the_real_shards(fsdp8_model):
    model, _, config = fsdp8_model
    text = summary(config, make_optimizer(config.optim).init, state_name(config.optim))
    parameters = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert f"parameters:        {parameters:,} (" in text
    assert f"FLOPs per token:   {flops_per_token(config.model, S):.4g}" in text
    assert "fsdp=8" in text
    # What one device really holds of the sharded model, counted from its shards.
    on_device0 = sum(
        shard.data.size
        for array in jax.tree.leaves(nnx.state(model, nnx.Param))
        for shard in array.addressable_shards
        if shard.device == jax.devices()[0]
    )
    assert f"memory per device: {on_device0:,} parameters x 4 bytes" in text


@pytest.mark.parametrize("name", ["adamw", "muon", "adafactor", "lion"])
def test_optimizer_state_bytes_per_device_match_the_real_shards(name):
    # Width 128 so that Adafactor factors the matrices (min_dim_size_to_factor=128).
    model = {**VARIANTS["untied"], "d_model": 128, "d_ff": 256, "vocab_size": 256}
    config = make_config(model, MESHES["fsdp8"], optim={"name": name})
    state = train.init_state(config)
    on_device0 = sum(
        shard.data.nbytes
        for array in jax.tree.leaves(state.opt_state)
        for shard in array.addressable_shards
        if shard.device == jax.devices()[0]
    )
    sizes = dict(state.params["embedding"].get_value().sharding.mesh.shape)
    abstract = jax.eval_shape(make_optimizer(config.optim).init, state.params)
    assert state_bytes_per_device(abstract, config, sizes) == on_device0


def test_cli_config_summary_for_llama3_8b():
    proc = kiln_main("config", "configs/models/llama3-8b.yaml", "--summary", cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "8,030,261,248" in proc.stdout
    assert "memory per device" in proc.stdout


@pytest.mark.parametrize("spec", ["BSD,DNH->BSNH", "BSNH,NHD->BSD"])
def test_projection_weight_gradient_in_float32_matches_float64(spec):
    """bf16 inputs, weight gradient computed (and so reduced) in float32, then rounded to bf16."""
    shapes = {"B": 2, "S": 8, "D": 16, "N": 2, "H": 4}
    inputs, rest = spec.split(",")
    weight, output = rest.split("->")
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, [shapes[c] for c in inputs]).astype(jnp.bfloat16)
    w = jax.random.normal(kw, [shapes[c] for c in weight]).astype(jnp.bfloat16)
    g = jax.random.normal(kg, [shapes[c] for c in output]).astype(jnp.bfloat16)
    with grad_reduce_dtype(jnp.float32):
        out, vjp = jax.vjp(lambda x, w: project(spec, x, w), x, w)
    dx, dw = vjp(g)
    x64, w64, g64 = (np.asarray(a, np.float64) for a in (x, w, g))
    assert out.dtype == dw.dtype == dx.dtype == jnp.bfloat16
    # bf16 results: one rounding to 8 mantissa bits, relative error <= 2^-8 (+ f32 summation).
    tol = dict(rtol=2**-8 + 1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out, np.float64), np.einsum(spec, x64, w64), **tol)
    want_dw = np.einsum(f"{inputs},{output}->{weight}", x64, g64)
    np.testing.assert_allclose(np.asarray(dw, np.float64), want_dw, **tol)
    # dx is the compute-dtype matmul jnp.einsum's own gradient computes: bf16 output, and an
    # absolute term for sums that cancel.
    want_dx = np.einsum(f"{output},{weight}->{inputs}", g64, w64)
    np.testing.assert_allclose(np.asarray(dx, np.float64), want_dx, rtol=2**-7, atol=2**-7)
    # Without a reduce dtype different from the compute dtype, it is jnp.einsum itself.
    with grad_reduce_dtype(None):
        assert jax.make_jaxpr(lambda x, w: project(spec, x, w))(x, w).eqns[0].primitive.name == (
            "dot_general"
        )
