"""The deepseek family: latent attention against a float64 reference (output and every
gradient), decoding in the latent space against the training attention, the multi-token
prediction loss against a hand-written one, 8 devices against one with accumulation and a
tiled loss, and the refusals of bad values."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import assert_user_error, kiln_main, make_config, write_config
from kiln.config import MESH_AXES
from kiln.model import attention as attention_module
from kiln.model import build_model, create_model, summary
from kiln.model.deepseek.mla import LatentAttention
from kiln.parallel.mesh import make_mesh, use_mesh
from kiln.training import train
from kiln.training.objective import LMObjective
from kiln.training.optim import make_optimizer, state_name
from test_moe import lm_batch, one_device, rel_err

D, S, V = 32, 16, 128
MLA = {"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6}


def ds_config(mesh=None, layers=3, moe=None, deepseek=None, **model):
    moe = {
        "num_experts": 8,
        "experts_per_token": 2,
        "d_ff_expert": 16,
        "num_shared_experts": 1,
        "first_dense_layers": 1,
        "score": "sigmoid",
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "balance": "aux_free",
        **(moe or {}),
    }
    m = {"family": "deepseek", "d_model": D, "num_heads": 2, "num_layers": layers, "d_ff": 48}
    m.update(vocab_size=V, max_seq_len=S, **model)
    return make_config(
        model={**m, "moe": moe, "deepseek": {**MLA, "q_lora_rank": 16, **(deepseek or {})}},
        data={"seq_len": S},
        mesh=mesh or {"fsdp": -1},
        train={"global_batch_size": 8},
    )


# ---------------------------------------------------------------------------------------------
# Latent attention against float64


def _rms(x, w, eps=1e-6):
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def mla_reference(p, x, positions, segments, cfg):
    """Latent attention written out head by head in float64 (run under x64): queries, the
    latent and its keys and values, rotary parts in the rotate-half layout, a masked softmax."""
    ds = cfg.deepseek
    a, r, half = ds.qk_nope_head_dim, ds.kv_lora_rank, ds.qk_rope_head_dim // 2
    if "wq" in p:
        q = jnp.einsum("bsd,dnh->bsnh", x, p["wq"])
    else:
        q = jnp.einsum("bsq,qnh->bsnh", _rms(x @ p["wq_a"], p["q_norm"]), p["wq_b"])
    kv = x @ p["wkv_a"]
    latent, k_rot = _rms(kv[..., :r], p["kv_norm"]), kv[..., r:]
    freq = 1.0 / cfg.rope_theta ** (np.arange(half) * 2.0 / (2 * half))
    angle = positions[..., None] * freq  # [b, s, half]

    def rotate(y):  # y [b, s, n, 2 half]
        cos, sin = jnp.cos(angle)[:, :, None], jnp.sin(angle)[:, :, None]
        y1, y2 = y[..., :half], y[..., half:]
        return jnp.concatenate([y1 * cos - y2 * sin, y2 * cos + y1 * sin], axis=-1)

    kv_up = jnp.einsum("bsr,rnk->bsnk", latent, p["wkv_b"])
    k_nope, v = kv_up[..., :a], kv_up[..., a:]
    q_rot, k_rot = rotate(q[..., a:]), rotate(k_rot[:, :, None])
    scores = jnp.einsum("bsnh,btnh->bnst", q[..., :a], k_nope)
    scores += jnp.einsum("bsnh,btoh->bnst", q_rot, k_rot)
    scores *= (a + 2 * half) ** -0.5
    s = x.shape[1]
    mask = (segments[:, :, None] == segments[:, None, :]) & np.tril(np.ones((s, s), bool))
    scores = jnp.where(mask[:, None], scores, -jnp.inf)
    out = jnp.einsum("bnst,btnv->bsnv", jax.nn.softmax(scores, axis=-1), v)
    return jnp.einsum("bsnv,nvd->bsd", out, p["wo"])


def attention_params(layer: LatentAttention) -> dict[str, np.ndarray]:
    names = ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b", "wo")
    p = {k: np.asarray(getattr(layer, k)[...]) for k in names if getattr(layer, k) is not None}
    p["kv_norm"] = np.asarray(layer.kv_norm.scale[...])
    if layer.q_norm is not None:
        p["q_norm"] = np.asarray(layer.q_norm.scale[...])
    return p


@pytest.fixture(scope="module")
def attention_inputs():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, S, D)).astype(np.float32)
    g = rng.standard_normal((2, S, D)).astype(np.float32)
    segments = np.ones((2, S), np.int32)
    segments[1, 9:] = 2  # a second document
    segments[1, -2:] = 0  # and padding
    positions = np.broadcast_to(np.arange(S, dtype=np.int32), (2, S)).copy()
    positions[1, 9:] = np.arange(S - 9)
    return x, g, positions, segments


def randomised(layer):
    """The layer with norm scales away from 1 (so that their gradients are tested)."""
    rng = np.random.default_rng(3)
    for norm in (layer.kv_norm, layer.q_norm):
        if norm is not None:
            n = norm.scale[...].shape
            norm.scale[...] = jnp.asarray(1 + 0.2 * rng.standard_normal(n), jnp.float32)
    return layer


@pytest.mark.parametrize("q_lora_rank", [None, 16], ids=["full-rank queries", "q_lora 16"])
def test_latent_attention_and_its_gradients_equal_the_float64_reference(
    attention_inputs, q_lora_rank
):
    x, g, positions, segments = attention_inputs
    cfg = ds_config(deepseek={"q_lora_rank": q_lora_rank}, init_std=0.2).model
    layer = randomised(LatentAttention(cfg, rngs=nnx.Rngs(1)))
    graphdef, state = nnx.split(layer)

    def loss(state, x):
        y = nnx.merge(graphdef, state)(x, positions, segments)
        return jnp.sum(y * g), y

    (_, y), (d_state, dx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        state, x
    )
    flat = {"/".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(d_state)}
    grads = {k.removesuffix("/scale"): v for k, v in flat.items()}

    params = attention_params(layer)
    with jax.enable_x64(True):
        p64 = {k: jnp.asarray(v, jnp.float64) for k, v in params.items()}

        def ref_loss(p, x):
            y = mla_reference(p, x, positions, segments, cfg)
            return jnp.sum(y * g), y

        (_, want_y), (want_grads, want_dx) = jax.value_and_grad(
            ref_loss, argnums=(0, 1), has_aux=True
        )(p64, jnp.asarray(x, jnp.float64))
        want_y, want_dx = np.asarray(want_y), np.asarray(want_dx)
        want_grads = {k: np.asarray(v) for k, v in want_grads.items()}
    assert rel_err(y, want_y) <= 1e-5  # tolerance: 1e-5 relative (float32)
    assert rel_err(dx, want_dx) <= 1e-5  # tolerance: 1e-5 relative (float32)
    assert set(want_grads) == set(grads)
    for name, want in want_grads.items():
        assert rel_err(grads[name], want) <= 1e-5, name  # tolerance: 1e-5 relative (float32)


def test_decoding_in_the_latent_space_equals_the_training_attention(attention_inputs):
    """A prefill of 10 tokens, then 6 tokens one at a time through the cache of latents and
    rotary keys (queries absorbed into the latent space), give the training attention's
    output at every position."""
    x, _, positions, _ = attention_inputs
    cfg = ds_config(init_std=0.2).model
    layer = randomised(LatentAttention(cfg, rngs=nnx.Rngs(2)))
    segments = np.ones((2, S), np.int32)
    want = layer(x, positions, segments)
    prefix = 10
    out, c, k = layer.cached(x[:, :prefix], positions[:, :prefix], segments[:, :prefix], None)
    latents = jnp.zeros((2, S, 1, MLA["kv_lora_rank"])).at[:, :prefix].set(c)
    keys = jnp.zeros((2, S, 1, MLA["qk_rope_head_dim"])).at[:, :prefix].set(k)
    cache_segments = np.zeros((2, S), np.int32)
    cache_segments[:, :prefix] = 1
    outs = [out]
    for i in range(prefix, S):
        cache_segments[:, i] = 1
        step = (x[:, i : i + 1], positions[:, i : i + 1], segments[:, i : i + 1])
        out, c, k = layer.cached(*step, (latents, keys, cache_segments, i))
        latents, keys = latents.at[:, i : i + 1].set(c), keys.at[:, i : i + 1].set(k)
        outs.append(out)
    got = jnp.concatenate(outs, axis=1)
    assert rel_err(got, want) <= 1e-5  # tolerance: 1e-5 relative (float32; another order)


def test_every_attention_implementation_runs_latent_attention_or_is_refused(monkeypatch):
    """splash (in Pallas' interpreter) takes the values zero-padded to the query width and
    gives xla's output; cuDNN is refused in one line on CPU, as for any model."""
    rng = np.random.default_rng(4)
    b, s, n = 1, 128, 2
    q = jnp.asarray(rng.standard_normal((b, s, n, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, s, n, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, s, n, 8)), jnp.float32)
    segments = jnp.ones((b, s), jnp.int32)
    want = attention_module.attention(q, k, v, segments, implementation="xla")
    assert want.shape == (b, s, n, 8)
    splash = functools.partial(attention_module.splash_attention, interpret=True)
    monkeypatch.setitem(attention_module.IMPLEMENTATIONS, "splash", splash)
    got = attention_module.attention(q, k, v, segments, implementation="splash")
    assert rel_err(got, want) <= 1e-5  # tolerance: 1e-5 relative (float32, another kernel)
    with pytest.raises(Exception, match="runs on GPU only"):
        attention_module.attention(q, k, v, segments, implementation="cudnn")


# ---------------------------------------------------------------------------------------------
# Multi-token prediction


def _ce64(hidden, head, targets, weights):
    """sum(w * cross-entropy) and sum(w) in float64."""
    logits = np.asarray(hidden, np.float64) @ np.asarray(head, np.float64)
    top = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    picked = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return float(np.sum(weights * (lse - picked))), float(np.sum(weights))


def test_multi_token_prediction_loss_equals_the_hand_written_one():
    """Two modules: module d reads the previous depth's residual stream and the embedding of
    the token d ahead, and its loss is the cross-entropy of the token d+1 ahead, where that
    token is in the same document, weighted by its own weight; learning/mtp_loss is the mean
    of the two per-token means and the loss adds it times mtp_loss_weight."""
    config = ds_config(
        layers=1,
        moe={"first_dense_layers": 0},
        deepseek={"mtp_num_layers": 2, "mtp_loss_weight": 0.25},
    )
    model = build_model(config.model, rngs=nnx.Rngs(0))
    batch = lm_batch(config)
    batch["segment_ids"][:, 7:] = np.where(batch["segment_ids"][:, 7:] > 0, 2, 0)  # 2 documents
    batch["weights"][::2, :5] = 0.0  # prompts that weigh nothing
    batch["weights"][1] *= 0.5
    objective = LMObjective(config=config, mesh=None)
    graphdef, state = nnx.split(model)

    @jax.jit
    def objective_of(state, batch):
        value, sums = objective.loss_sums(nnx.merge(graphdef, state), batch)
        return value, sums, objective.finalize(sums)

    value, sums, (loss, metrics) = objective_of(state, batch)

    # By hand: the modules run one by one on the decoder's last residual stream.
    inputs, seg = batch["inputs"], batch["segment_ids"]
    h, _, _ = model.trunk(inputs, batch["positions"], seg)
    params = nnx.state(model.mtp)
    graphdef = nnx.graphdef(model.mtp)
    head = model.head_weight()
    means = []

    @jax.jit
    def run_module(layer_params, h, shifted):
        module = nnx.merge(graphdef, layer_params)
        h, _ = module(h, model.embed(shifted), batch["positions"], seg)
        return h, module.final_norm(h)

    for d in (1, 2):
        shifted = np.zeros_like(inputs)
        shifted[:, :-d] = inputs[:, d:]
        h, normed = run_module(jax.tree.map(lambda x, d=d: x[d - 1], params), h, shifted)
        targets = np.zeros_like(inputs)
        weights = np.zeros_like(batch["weights"])
        for i in range(S - d):
            same = (seg[:, i + d] == seg[:, i]) & (seg[:, i] > 0)
            targets[:, i] = np.where(same, batch["targets"][:, i + d], 0)
            weights[:, i] = np.where(same, batch["weights"][:, i + d], 0.0)
        total, weight = _ce64(normed, head, targets, weights)
        assert sums[f"ahead_{d}_weight_sum"] == pytest.approx(weight, rel=1e-6)  # float32 sum
        means.append(total / weight)
    want_mtp = sum(means) / 2
    lm_total, lm_weight = _ce64(
        model.hidden_states(inputs, batch["positions"], seg).hidden,
        head,
        batch["targets"],
        batch["weights"],
    )
    assert metrics["learning/mtp_loss"] == pytest.approx(want_mtp, rel=1e-5)  # float32
    assert loss == pytest.approx(lm_total / lm_weight + 0.25 * want_mtp, rel=1e-5)  # float32
    # The value (summed over micro-batches, divided by the weight) has the loss's gradient.
    assert value / sums["weight_sum"] == pytest.approx(float(loss), rel=1e-5)  # float32


def train_steps(config, batch, steps=3):
    """(learning/loss, learning/raw_grad_norm) of `steps` train steps on `config`'s mesh."""
    sizes = [getattr(config.mesh, a) for a in MESH_AXES]
    mesh = make_mesh(config, jax.devices()[: 8 if -1 in sizes else int(np.prod(sizes))])
    state = train.init_state(config, mesh)
    step = train.make_train_step(config, mesh, train.shardings_of(state))
    out = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        out.append((float(metrics["learning/loss"]), float(metrics["learning/raw_grad_norm"])))
    return np.array(out)


def test_eight_devices_with_accumulation_and_tiling_equal_one_device():
    """3 steps with mesh.expert=4 mesh.fsdp=2 (8 devices), gradient accumulation 2 and the
    loss tiled over the vocabulary (the module's loss too) equal the same global batch in
    one untiled micro-batch on one device, within 1e-5 relative: each step's loss (with the
    router z-loss and a prediction module) and gradient norm. One routed layer and the
    module: dense layers on the expert axis are tests/test_moe.py's. (The load-balance loss
    is a product of per-micro-batch means, so accumulation changes it by design; its expert
    parallelism is checked in tests/test_moe.py with the same accumulation on both sides,
    gradients element by element.)"""
    moe = {"router_z_loss": 1e-3, "first_dense_layers": 0}
    mtp = {"mtp_num_layers": 1}
    base = ds_config(mesh={"expert": 4, "fsdp": 2}, layers=1, moe=moe, deepseek=mtp)
    train_cfg = base.train.model_copy(
        update={"gradient_accumulation_steps": 2, "global_batch_size": 16}
    )
    config = base.model_copy(
        update={
            "train": train_cfg,
            "loss": base.loss.model_copy(update={"num_vocab_tiling": 2}),
        }
    )
    reference = one_device(config).model_copy(
        update={
            "train": train_cfg.model_copy(update={"gradient_accumulation_steps": 1}),
            "loss": base.loss,
        }
    )
    batch = lm_batch(config)
    want = train_steps(reference, batch)
    got = train_steps(config, batch)
    assert rel_err(got[:, 0], want[:, 0]) <= 1e-5  # tolerance: 1e-5 relative (float32)
    assert rel_err(got[:, 1], want[:, 1]) <= 1e-5  # tolerance: 1e-5 relative (float32)


def test_generate_runs_no_prediction_module_and_caches_latents():
    """The cache holds latents and rotary keys; the summary's bytes per token are theirs."""
    config = ds_config(deepseek={"mtp_num_layers": 1})
    model = build_model(config.model, rngs=nnx.Rngs(0))
    cache = model.init_cache(2, S)
    assert cache.k.shape == (3, 2, S, 1, MLA["kv_lora_rank"])
    assert cache.v.shape == (3, 2, S, 1, MLA["qk_rope_head_dim"])
    per_token = (MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]) * 3 * 4
    assert model.cache_bytes_per_token()[0] == per_token
    tokens = np.arange(1, 7, dtype=np.int32).reshape(2, 3)
    pos = np.broadcast_to(np.arange(3, dtype=np.int32), (2, 3))
    hidden, cache = model.extend(tokens, pos, np.ones((2, 3), np.int32), cache, fresh=True)
    want = model.hidden_states(tokens, pos, np.ones((2, 3), np.int32)).hidden
    assert rel_err(hidden, want) <= 1e-5  # tolerance: 1e-5 relative (float32)
    text = summary(config, make_optimizer(config.optim).init, state_name(config.optim))
    assert f"decode cache:      {per_token:,} bytes per token" in text
    assert "mtp modules:" in text


# ---------------------------------------------------------------------------------------------
# Bad values


@pytest.mark.parametrize(
    "override, field",
    [
        ("model.deepseek.kv_lora_rank=0", "kv_lora_rank"),
        ("model.moe.topk_group=8", "topk_group"),
        ("model.moe.n_group=3", "n_group"),
        ("model.deepseek.qk_rope_head_dim=5", "qk_rope_head_dim"),
        ("model.num_kv_heads=1", "num_kv_heads"),
    ],
)
def test_bad_values_are_refused_in_one_line_naming_the_field(tmp_path, override, field):
    config = write_config(tmp_path / "c.yaml", ds_config().model_dump(mode="json"))
    proc = kiln_main("config", config, override)
    assert_user_error(proc, field)


def test_multi_token_prediction_on_a_family_without_it_is_refused(tmp_path):
    raw = ds_config().model_dump(mode="json")
    raw["model"]["family"] = "moe"
    config = write_config(tmp_path / "c.yaml", raw)
    proc = kiln_main("config", config)
    assert_user_error(proc, "model.deepseek")


def _forward(config, mesh, batch):
    """(hidden, the prediction module's hidden, aux) of the model `config` builds from seed 0,
    under jit on `mesh` (None: unsharded)."""
    if mesh is None:
        model = build_model(config.model, rngs=nnx.Rngs(0))
    else:
        model = create_model(config, mesh, 0)
    graphdef, state = nnx.split(model)

    def forward(state, inputs, positions, segments):
        out = nnx.merge(graphdef, state).hidden_states(inputs, positions, segments)
        return out.hidden, out.ahead[0], out.aux

    args = (batch["inputs"], batch["positions"], batch["segment_ids"])
    with use_mesh(mesh, config.mesh.rules if mesh else None):
        return jax.jit(forward)(state, *args)


def test_tensor_and_sequence_parallel_forward_equals_one_device():
    """fsdp 2 x tensor 2 x sequence 2: heads split over tensor (latent attention's queries,
    expanded keys and values), the sequence over sequence (the prediction module's shift
    crosses shards) give the unsharded model's hidden states, module output and router
    sums within 1e-5."""
    config = ds_config(
        mesh={"fsdp": 2, "tensor": 2, "sequence": 2},
        layers=1,
        moe={"first_dense_layers": 0},
        deepseek={"mtp_num_layers": 1},
    )
    batch = lm_batch(config)
    mesh = make_mesh(config, jax.devices()[:8])
    want = _forward(config, None, batch)
    got = _forward(config, mesh, batch)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert rel_err(a, b) <= 1e-5  # tolerance: 1e-5 relative (float32, another order)
