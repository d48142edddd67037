"""Losses against float64 numpy references, and the tiled LM loss against the untiled one."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import with_expert
from kiln import losses
from kiln.config import MESH_AXES
from kiln.losses import cross_entropy, lm_loss

AXES = ("data", "fsdp", "tensor", "sequence")  # the mesh below adds expert=1
# Mesh shapes (data, fsdp, tensor, sequence) on the 8 simulated devices.
MESHES = {
    "none": None,
    "fsdp8": (1, 8, 1, 1),
    "data2_fsdp2_tensor2": (2, 2, 2, 1),
    "data4_tensor2": (4, 1, 2, 1),
    "data2_tensor2_sequence2": (2, 1, 2, 2),
}
B, S, D, V = 8, 16, 16, 128


def rel_err(actual, expected) -> float:
    """Largest absolute error relative to the largest reference magnitude (absolute if that is 0)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = np.max(np.abs(expected))
    return float(np.max(np.abs(actual - expected)) / (scale if scale > 0 else 1.0))


# --------------------------------------------------------------------------- references


def ref_cross_entropy(x, y, z, eps, ct_loss, ct_z):
    """float64 (loss, z-term, d(ct_loss . loss + ct_z . z-term)/dx) straight from the definition."""
    x = np.asarray(x, np.float64)
    vocab = x.shape[-1]
    m = x.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))[..., 0]
    p = np.exp(x - lse[..., None])
    t = (1 - eps) * np.eye(vocab)[y] + eps / vocab
    z_term = z * lse**2
    loss = np.sum(t * (lse[..., None] - x), -1) + z_term
    grad = ct_loss[..., None] * ((1 + 2 * z * lse)[..., None] * p - t)
    grad += ct_z[..., None] * (2 * z * lse)[..., None] * p
    return loss, z_term, grad


def ref_lm_loss(h, w_dv, y, wt, z, eps, cap):
    """float64 sums and gradients of loss_sum w.r.t. hidden, head and weights."""
    h = np.asarray(h, np.float64).reshape(-1, np.shape(h)[-1])
    w_dv = np.asarray(w_dv, np.float64)
    y, wt = np.asarray(y).reshape(-1), np.asarray(wt, np.float64).reshape(-1)
    raw = h @ w_dv
    x = cap * np.tanh(raw / cap) if cap else raw
    loss, z_term, g = ref_cross_entropy(x, y, z, eps, wt, np.zeros_like(wt))
    if cap:
        g = g * (1 - np.tanh(raw / cap) ** 2)
    sums = {"loss_sum": loss @ wt, "z_loss_sum": z_term @ wt, "weight_sum": wt.sum()}
    return sums, (g @ w_dv.T, h.T @ g, loss)


# --------------------------------------------------------------------------- cross_entropy


@pytest.fixture(scope="module")
def ce_data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 128)).astype(np.float32)
    y = rng.integers(0, 128, 64).astype(np.int32)
    cts = rng.uniform(0.5, 1.5, (2, 64)).astype(np.float32)
    return x, y, cts


@functools.partial(jax.jit, static_argnums=(4, 5))
def ce_vjp(x, y, ct_loss, ct_z, z, eps):
    f = functools.partial(cross_entropy, z_loss_multiplier=z, label_smoothing=eps)
    (loss, z_term), vjp = jax.vjp(lambda x: f(x, y), x)
    return loss, z_term, vjp((ct_loss, ct_z))[0]


@pytest.mark.parametrize("scale", [1.0, 30.0, 3000.0])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("z", [0.0, 1e-4, 1e-2])
def test_cross_entropy_matches_float64_reference(ce_data, z, eps, scale):
    x, y, (ct_loss, ct_z) = ce_data
    x = x * np.float32(scale)
    loss, z_term, grad = ce_vjp(x, y, ct_loss, ct_z, z, eps)
    ref_loss, ref_z, ref_grad = ref_cross_entropy(x, y, z, eps, ct_loss, ct_z)
    assert loss.dtype == z_term.dtype == jnp.float32
    assert rel_err(loss, ref_loss) <= 2e-5  # tolerance: 2e-5 relative (float32 vs float64)
    assert rel_err(grad, ref_grad) <= 2e-5  # tolerance: 2e-5 relative
    if z:
        assert rel_err(z_term, ref_z) <= 2e-5  # tolerance: 2e-5 relative
    else:
        assert np.all(np.asarray(z_term) == 0)  # tolerance: exact, no z-loss means no z-term


def test_cross_entropy_logits_of_magnitude_1e4(ce_data):
    x, y, (ct_loss, ct_z) = ce_data
    x = x / np.abs(x).max() * np.float32(1e4)
    loss, z_term, grad = ce_vjp(x, y, ct_loss, ct_z, 1e-4, 0.1)
    ref_loss, ref_z, ref_grad = ref_cross_entropy(x, y, 1e-4, 0.1, ct_loss, ct_z)
    assert np.all(np.isfinite(loss)) and np.all(np.isfinite(grad))
    assert rel_err(loss, ref_loss) <= 2e-5  # tolerance: 2e-5 relative
    assert rel_err(z_term, ref_z) <= 2e-5  # tolerance: 2e-5 relative
    assert rel_err(grad, ref_grad) <= 2e-5  # tolerance: 2e-5 relative


def test_cross_entropy_bf16_inputs_give_float32(ce_data):
    x, y, (ct_loss, ct_z) = ce_data
    x16 = jnp.asarray(x * 30, jnp.bfloat16)
    loss, z_term, grad = ce_vjp(x16, y, ct_loss, ct_z, 1e-2, 0.1)
    ref_loss, ref_z, ref_grad = ref_cross_entropy(
        np.asarray(x16, np.float32), y, 1e-2, 0.1, ct_loss, ct_z
    )
    assert loss.dtype == z_term.dtype == jnp.float32
    assert grad.dtype == jnp.bfloat16  # a cotangent has its primal's dtype
    assert rel_err(loss, ref_loss) <= 2e-5  # tolerance: 2e-5 relative, computed in float32
    assert rel_err(z_term, ref_z) <= 2e-5  # tolerance: 2e-5 relative
    assert rel_err(grad, ref_grad) <= 2**-8  # tolerance: one bfloat16 rounding of the gradient


def test_cross_entropy_without_z_is_plain_cross_entropy_bitwise(ce_data):
    x, y, _ = ce_data
    x = jnp.asarray(x * 30)

    def both(x):
        loss, z_term = cross_entropy(x, y)
        # Plain cross-entropy from max-shifted terms (m - x_y) + log sum exp(x - m): the form
        # that keeps float32 relative precision at any common logit offset.
        m = jnp.max(x, axis=-1)
        x_y = jnp.take_along_axis(x, y[:, None], axis=-1)[:, 0]
        plain = (m - x_y) + jnp.log(jnp.sum(jnp.exp(x - m[:, None]), axis=-1))
        return loss, z_term, plain

    for loss, z_term, plain in (both(x), jax.jit(both)(x)):
        np.testing.assert_array_equal(loss, plain)  # tolerance: bitwise
        np.testing.assert_array_equal(z_term, 0.0)  # tolerance: bitwise


# --------------------------------------------------------------------------- lm_loss


@pytest.fixture(scope="module")
def lm_data():
    rng = np.random.default_rng(1)
    hidden = rng.standard_normal((B, S, D)).astype(np.float32)
    head = (rng.standard_normal((D, V)) / 2).astype(np.float32)
    targets = rng.integers(0, V, (B, S)).astype(np.int32)
    weights = (rng.uniform(size=(B, S)) > 0.25).astype(np.float32)  # ~1/4 padding
    return hidden, head, targets, weights


def make_mesh(shape, explicit=False):
    if shape is None:
        return None
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(with_expert(shape), MESH_AXES, axis_types=(kind,) * len(MESH_AXES))


def place(mesh, hidden, head, targets, weights):
    """Arrays sharded per the default rules: tokens on (data, fsdp) x sequence, head on fsdp x tensor."""
    if mesh is None:
        return tuple(jnp.asarray(a) for a in (hidden, head, targets, weights))
    tok, hd = P(("data", "fsdp", "expert"), "sequence"), P("fsdp", "tensor")
    specs = (P(*tok, None), hd, tok, tok)
    return tuple(
        jax.device_put(a, NamedSharding(mesh, s))
        for a, s in zip((hidden, head, targets, weights), specs)
    )


@functools.cache
def lm_vjp(mesh, chunks, z, eps, cap, vocab_chunk=None):
    """Jitted (sums, grads w.r.t. hidden, head, weights) for cotangents (loss, z_loss, weight)."""

    def run(hidden, head, targets, weights, cts):
        def f(hidden, head, weights):
            out = lm_loss(
                hidden,
                head,
                targets,
                weights,
                z_loss_multiplier=z,
                label_smoothing=eps,
                logit_softcap=cap,
                num_vocab_tiling=chunks,
                mesh=mesh,
                vocab_chunk_size=vocab_chunk,
            )
            return out["loss_sum"], out["z_loss_sum"], out["weight_sum"]

        sums, vjp = jax.vjp(f, hidden, head, weights)
        return dict(zip(("loss_sum", "z_loss_sum", "weight_sum"), sums)), vjp(cts)

    return jax.jit(run)


ONE = (jnp.float32(1), jnp.float32(0), jnp.float32(0))
# A differentiated z_loss_sum (and weight_sum) as well: every cotangent must reach the grads.
MIXED = (jnp.float32(0.5), jnp.float32(2.0), jnp.float32(0.25))
SETTINGS = {"plain": (0.0, 0.0, None), "z": (1e-2, 0.0, None), "all": (1e-3, 0.1, 10.0)}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_untiled_lm_loss_matches_float64_reference(lm_data, setting):
    z, eps, cap = SETTINGS[setting]
    sums, grads = lm_vjp(None, 1, z, eps, cap)(*place(None, *lm_data), ONE)
    ref_sums, (ref_dh, ref_dw, ref_loss_tok) = ref_lm_loss(*lm_data, z, eps, cap)
    for key, value in sums.items():
        assert value.dtype == jnp.float32
        assert rel_err(value, ref_sums[key]) <= 2e-5, key  # tolerance: 2e-5 relative
    assert rel_err(grads[0].reshape(-1, D), ref_dh) <= 2e-5  # tolerance: 2e-5 relative
    assert rel_err(grads[1], ref_dw) <= 2e-5  # tolerance: 2e-5 relative
    assert rel_err(grads[2].reshape(-1), ref_loss_tok) <= 2e-5  # tolerance: 2e-5 relative


def assert_same(tiled, untiled):
    (t_sums, t_grads), (u_sums, u_grads) = tiled, untiled
    for key in u_sums:
        assert rel_err(t_sums[key], u_sums[key]) <= 1e-5, key  # tolerance: 1e-5 relative
    for name, t, u in zip(("hidden", "head", "weights"), t_grads, u_grads):
        assert t.shape == u.shape and t.dtype == u.dtype, name
        assert rel_err(t, u) <= 1e-5, name  # tolerance: 1e-5 relative (float32)


@pytest.mark.parametrize("chunks", [2, 4, 16])
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_tiled_matches_untiled_on_meshes(lm_data, mesh_name, chunks):
    mesh = make_mesh(MESHES[mesh_name])
    args = place(mesh, *lm_data)
    z, eps, cap = SETTINGS["all"]
    for cts in (ONE, MIXED):
        untiled = lm_vjp(mesh, 1, z, eps, cap)(*args, cts)
        tiled = lm_vjp(mesh, chunks, z, eps, cap)(*args, cts)
        assert_same(tiled, untiled)


@pytest.mark.parametrize("setting", ["plain", "z"])
def test_tiled_matches_untiled_settings(lm_data, setting):
    args = place(None, *lm_data)
    for cts in (ONE, MIXED):
        assert_same(
            lm_vjp(None, 4, *SETTINGS[setting])(*args, cts),
            lm_vjp(None, 1, *SETTINGS[setting])(*args, cts),
        )


@pytest.mark.parametrize(("chunks", "vocab_chunk"), [(1, 16), (4, 32)])
@pytest.mark.parametrize("mesh_name", ["none", "data2_fsdp2_tensor2", "data2_tensor2_sequence2"])
def test_vocab_chunks_match_untiled(lm_data, mesh_name, chunks, vocab_chunk):
    mesh = make_mesh(MESHES[mesh_name])
    args = place(mesh, *lm_data)
    z, eps, cap = SETTINGS["all"]
    for cts in (ONE, MIXED):
        untiled = lm_vjp(mesh, 1, z, eps, cap)(*args, cts)
        assert_same(lm_vjp(mesh, chunks, z, eps, cap, vocab_chunk)(*args, cts), untiled)


def test_tiled_matches_untiled_on_explicit_mesh(lm_data):
    mesh = make_mesh(MESHES["data2_fsdp2_tensor2"], explicit=True)
    args = place(mesh, *lm_data)
    z, eps, cap = SETTINGS["all"]
    tiled = lm_vjp(mesh, 4, z, eps, cap)(*args, MIXED)
    assert_same(tiled, lm_vjp(mesh, 1, z, eps, cap)(*args, MIXED))
    assert tiled[1][1].sharding.spec == P("fsdp", "tensor")  # gradient sharded like the head


@pytest.mark.parametrize("mesh_name", ["none", "data2_fsdp2_tensor2"])
def test_tied_embedding_gradients(lm_data, mesh_name):
    """The head is the embedding [V, D] transposed; its gradient flows through the transpose."""
    mesh = make_mesh(MESHES[mesh_name])
    hidden, head, targets, weights = place(mesh, *lm_data)
    embedding = (
        head.T if mesh is None else jax.device_put(head.T, NamedSharding(mesh, P("tensor", "fsdp")))
    )

    @functools.partial(jax.jit, static_argnums=0)
    def grads(chunks, hidden, embedding):
        def f(hidden, embedding):
            out = lm_loss(
                hidden,
                embedding.T,
                targets,
                weights,
                z_loss_multiplier=1e-3,
                num_vocab_tiling=chunks,
                mesh=mesh,
            )
            return out["loss_sum"]

        return jax.grad(f, argnums=(0, 1))(hidden, embedding)

    for t, u in zip(grads(4, hidden, embedding), grads(1, hidden, embedding)):
        assert rel_err(t, u) <= 1e-5  # tolerance: 1e-5 relative (float32)


@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("mesh_name", ["none", "data2_fsdp2_tensor2"])
def test_doubling_the_loss_doubles_the_gradients(lm_data, mesh_name, chunks):
    mesh = make_mesh(MESHES[mesh_name])
    args = place(mesh, *lm_data)
    run = lm_vjp(mesh, chunks, *SETTINGS["all"])
    _, once = run(*args, ONE)
    _, twice = run(*args, tuple(2 * c for c in ONE))
    for g1, g2 in zip(once, twice):
        assert (
            rel_err(g2, 2 * g1) <= 1e-6
        )  # tolerance: 1e-6 relative; a dropped cotangent is off by 2x
    # Mean-normalised loss, as callers compute it: cotangent 1 / weight_sum.
    sums, mean = run(*args, (1 / jnp.sum(args[3]), jnp.float32(0), jnp.float32(0)))
    for g1, g in zip(once, mean):
        assert rel_err(g * sums["weight_sum"], g1) <= 1e-6  # tolerance: 1e-6 relative


def test_bf16_tiled_head_gradient_accumulates_in_float32(lm_data):
    hidden, head, targets, weights = lm_data
    h16, w16 = jnp.asarray(hidden, jnp.bfloat16), jnp.asarray(head, jnp.bfloat16)
    sums, grads = lm_vjp(None, 64, 1e-3, 0.0, None)(
        h16, w16, jnp.asarray(targets), jnp.asarray(weights), ONE
    )
    ref_sums, (ref_dh, ref_dw, _) = ref_lm_loss(
        np.asarray(h16, np.float32), np.asarray(w16, np.float32), targets, weights, 1e-3, 0.0, None
    )
    assert all(v.dtype == jnp.float32 for v in sums.values())
    assert grads[0].dtype == grads[1].dtype == jnp.bfloat16
    assert rel_err(sums["loss_sum"], ref_sums["loss_sum"]) <= 2e-5  # tolerance: 2e-5, float32 math
    # 64 chunks of 2 tokens: summing their head gradients in bfloat16 would lose ~64 roundings.
    assert rel_err(grads[1], ref_dw) <= 2**-8  # tolerance: one bfloat16 rounding
    assert rel_err(grads[0].reshape(-1, D), ref_dh) <= 2**-8  # tolerance: one bfloat16 rounding


def _largest_array(hlo_text: str) -> int:
    """Element count of the largest array shape in HLO text."""
    shapes = re.findall(r"\b(?:f32|bf16|f16|s32|pred)\[([\d,]+)\]", hlo_text)
    return max(int(np.prod([int(d) for d in s.split(",")])) for s in shapes)


@pytest.mark.parametrize("mesh_name", ["none", "data2_fsdp2_tensor2"])
def test_tiled_never_holds_the_full_logits(mesh_name):
    mesh = make_mesh(MESHES[mesh_name])
    rng = np.random.default_rng(2)
    batch, seq, d_model, vocab, chunks = 8, 32, 16, 256, 4
    args = place(
        mesh,
        rng.standard_normal((batch, seq, d_model)).astype(np.float32),
        rng.standard_normal((d_model, vocab)).astype(np.float32),
        rng.integers(0, vocab, (batch, seq)).astype(np.int32),
        np.ones((batch, seq), np.float32),
    )
    # Per-device logits: the mesh splits tokens 4 ways (data x fsdp) and vocab 2 ways (tensor).
    local_logits = batch * seq * vocab // (1 if mesh is None else 8)

    def compiled(num_chunks, vocab_chunk=None):
        def f(hidden, head, targets, weights):
            out = lm_loss(
                hidden,
                head,
                targets,
                weights,
                z_loss_multiplier=1e-4,
                num_vocab_tiling=num_chunks,
                mesh=mesh,
                vocab_chunk_size=vocab_chunk,
            )
            return out["loss_sum"]

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1))).lower(*args).compile()

    untiled, tiled, vocab_chunked = compiled(1), compiled(chunks), compiled(chunks, 32)
    assert _largest_array(untiled.as_text()) >= local_logits  # the check can see logits
    assert _largest_array(tiled.as_text()) <= local_logits // chunks  # tolerance: one chunk at most
    temp = {
        name: c.memory_analysis().temp_size_in_bytes
        for name, c in (("untiled", untiled), ("tiled", tiled), ("vocab", vocab_chunked))
    }
    assert temp["tiled"] <= 0.5 * temp["untiled"]  # tolerance: 4 chunks must at least halve it
    assert temp["vocab"] < temp["tiled"]  # chunking the vocabulary as well saves more


def test_fsdp_head_gradient_is_reduce_scattered(lm_data):
    """Each device keeps only its FSDP shard of the tiled head gradient, as of the head."""
    mesh = make_mesh(MESHES["fsdp8"])
    hidden, head, targets, weights = place(mesh, *lm_data)

    def f(hidden, head):
        return lm_loss(hidden, head, targets, weights, num_vocab_tiling=4, mesh=mesh)["loss_sum"]

    compiled = jax.jit(jax.grad(f, argnums=(0, 1))).lower(hidden, head).compile()
    assert "reduce-scatter" in compiled.as_text()
    assert compiled.output_shardings[1].spec == P("fsdp")


def test_rejects_chunks_not_dividing_shard_tokens(lm_data):
    mesh = make_mesh(MESHES["fsdp8"])  # 16 tokens per shard
    args = place(mesh, *lm_data)
    with pytest.raises(ValueError, match=r"num_vocab_tiling=32 does not divide the 16 tokens"):
        lm_vjp(mesh, 32, 0.0, 0.0, None)(*args, ONE)


def test_rejects_vocab_chunk_not_dividing_shard_vocab(lm_data):
    mesh = make_mesh(MESHES["data2_fsdp2_tensor2"])  # 64 vocabulary entries per shard
    args = place(mesh, *lm_data)
    with pytest.raises(ValueError, match=r"vocab_chunk_size=48 does not divide the 64"):
        lm_vjp(mesh, 2, 0.0, 0.0, None, 48)(*args, ONE)


# --------------------------------------------------------------------------- values given as arrays


def _bad_values_data():
    """Small student, teacher and top-k inputs: [2, 4] tokens, hidden 8, vocabulary 16."""
    rng = np.random.default_rng(3)
    hs, ht = (jnp.asarray(rng.standard_normal((2, 4, 8)), jnp.float32) for _ in range(2))
    ws, wt = (jnp.asarray(rng.standard_normal((8, 16)) / 2, jnp.float32) for _ in range(2))
    y = jnp.asarray(rng.integers(0, 16, (2, 4)), jnp.int32)
    w = jnp.ones((2, 4), jnp.float32)
    x_t = losses.logits(ht, wt) / 2.0
    values, ids = jax.lax.top_k(x_t * 2.0, 4)
    top = losses.TopK(values, ids, jax.nn.logsumexp(x_t, axis=-1))
    return hs, ws, ht, wt, y, w, top


def _call(fn: str, arg: str, value):
    """The loss `fn` on the data above with `arg` set to `value`; the output computed from it."""
    hs, ws, ht, wt, y, w, top = _bad_values_data()
    kw = {"temperature": 2.0, "weights": w, "alpha": 0.5, "beta": 1.0, "coefficients": (1.0, 0.5)}
    kw[arg] = value
    t, wts = kw["temperature"], kw["weights"]
    if fn == "lm_loss":
        return lm_loss(hs, ws, y, wts)["loss_sum"]
    if fn == "soft_loss":
        return losses.soft_loss(losses.logits(hs, ws), losses.logits(ht, wt), t)
    if fn == "top_k_soft_loss":
        return losses.top_k_soft_loss(losses.logits(hs, ws), top, t)
    if fn == "soft_loss_sums":
        return losses.soft_loss_sums(hs, ws, ht, wt, y, wts, temperature=t)["soft_sum"]
    if fn == "distill_loss_sums":
        out = losses.distill_loss_sums(
            hs, ws, ht, wt, y, wts, temperature=t, coefficients=kw["coefficients"]
        )
        return out["objective_sum"]
    if fn == "top_k_distill_loss_sums":
        out = losses.top_k_distill_loss_sums(
            hs, ws, top, y, wts, temperature=t, coefficients=kw["coefficients"]
        )
        return out["objective_sum"]
    assert fn == "distillation_loss"
    h, s, f = jnp.float32(2.0), jnp.float32(0.5), jnp.float32(0.25)
    return losses.distillation_loss(h, s, f, alpha=kw["alpha"], beta=kw["beta"], balance="none")[0]


NAN, INF = float("nan"), float("inf")
ALL_MINUS_ONE = np.full((2, 4), -1.0, np.float32)
# (function, argument, bad value, the argument's name in the ValueError)
BAD_VALUES = [
    ("soft_loss", "temperature", NAN, "temperature"),
    ("soft_loss", "temperature", -1.0, "temperature"),
    ("soft_loss", "temperature", 0.0, "temperature"),
    ("top_k_soft_loss", "temperature", INF, "temperature"),
    ("soft_loss_sums", "temperature", -1.0, "temperature"),
    ("distill_loss_sums", "temperature", NAN, "temperature"),
    ("top_k_distill_loss_sums", "temperature", -2.0, "temperature"),
    ("distillation_loss", "alpha", INF, "alpha"),
    ("distillation_loss", "alpha", 1.5, "alpha"),
    ("distillation_loss", "beta", -1.0, "beta"),
    ("distillation_loss", "beta", NAN, "beta"),
    ("lm_loss", "weights", ALL_MINUS_ONE, r"weights_BS .* got -1\.0 at position \(0, 0\)"),
    ("lm_loss", "weights", np.ones((2, 4), np.float32) * [1, 1, 1, NAN], r"at position \(0, 3\)"),
    ("lm_loss", "weights", np.ones((2, 4), np.float32) * [1, INF, 1, 1], r"at position \(0, 1\)"),
    ("soft_loss_sums", "weights", ALL_MINUS_ONE, "weights_BS"),
    ("distill_loss_sums", "weights", ALL_MINUS_ONE, "weights_BS"),
    ("top_k_distill_loss_sums", "weights", ALL_MINUS_ONE, "weights_BS"),
    ("distill_loss_sums", "coefficients", (jnp.float32(1), jnp.float32(-1)), r"coefficients\[1\]"),
    ("top_k_distill_loss_sums", "coefficients", (jnp.float32(INF), 1.0), r"coefficients\[0\]"),
]


@pytest.mark.parametrize(("fn", "arg", "bad", "name"), BAD_VALUES)
def test_bad_values_given_as_arrays(fn, arg, bad, name):
    """A NaN, infinite or out-of-range setting or weight passed as a JAX array: a ValueError
    naming it when the array is concrete; under jit, NaN in the result (never a plausible
    number), while a valid traced value gives the result the concrete array gives."""
    as_array = jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), bad)
    with pytest.raises(ValueError, match=name):
        _call(fn, arg, as_array)
    traced = jax.jit(lambda v: _call(fn, arg, v))
    assert np.all(np.isnan(traced(as_array)))
    good = {"temperature": 2.0, "alpha": 0.5, "beta": 1.0, "coefficients": (1.0, 0.5)}
    good["weights"] = _bad_values_data()[5]
    value = jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), good[arg])
    result = traced(value)
    assert np.all(np.isfinite(result))
    # tolerance: 1e-5 relative, float32 rounding of the same operations fused differently by
    # jit (a per-token KL of a few terms differs by up to ~1.2e-6)
    np.testing.assert_allclose(result, _call(fn, arg, value), rtol=1e-5)
