"""The one tiled engine: soft loss tiling, the fused hard + soft pass in both gradient modes,
precision at logit offsets and near KL = 0, argument checks, and the distillation combination."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import blocked_and_whole, with_expert
from kiln import losses
from kiln.config import MESH_AXES, config_from_dict
from kiln.errors import KilnError
from kiln.losses import CpuBlocked, schedule

AXES = ("data", "fsdp", "tensor", "sequence")  # make_mesh adds expert=1
B, S, D, E, V = 8, 16, 16, 24, 128
T = 1.7


def rel_err(actual, expected) -> float:
    """Largest absolute error relative to the largest reference magnitude."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = np.max(np.abs(expected))
    return float(np.max(np.abs(actual - expected)) / (scale if scale > 0 else 1.0))


def log_softmax64(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def kl64(student, teacher, t):
    """float64 T^2 KL(teacher_T || student_T) as a sum of non-negative terms (no cancellation)."""
    ls = log_softmax64(np.asarray(student, np.float64) / t)
    lt = log_softmax64(np.asarray(teacher, np.float64) / t)
    d = lt - ls
    e = np.expm1(d)
    return t * t * np.sum(np.exp(ls) * (d * e - (e - d)), -1)


def ce64(x, y):
    """float64 cross-entropy from the definition, at any offset (float64 has 1e-16 relative)."""
    x = np.asarray(x, np.float64)
    return -np.take_along_axis(log_softmax64(x), np.asarray(y)[..., None], -1)[..., 0]


# --------------------------------------------------------------------------- cross-entropy offsets


def test_cross_entropy_at_a_large_offset_is_exact():
    loss, _ = losses.cross_entropy(jnp.asarray([[10000.0, 10000.5, 9999.0]]), jnp.asarray([0]))
    # float32 value of the exact 1.10413...: one rounding.
    np.testing.assert_allclose(float(loss[0]), 1.1041306, rtol=1e-7)


@pytest.mark.parametrize("offset", [0.0, 3e2, 1e4, 1e5])
def test_cross_entropy_keeps_relative_precision_at_any_offset(offset):
    rng = np.random.default_rng(3)
    hidden = rng.standard_normal((2, 16, D)).astype(np.float32)
    head = rng.standard_normal((D, V)).astype(np.float32) / 4
    targets = rng.integers(0, V, (2, 16)).astype(np.int32)
    weights = np.ones((2, 16), np.float32)
    # A constant column offset on the logits: hidden gets a feature of 1, the head a row of offset.
    h = np.concatenate([hidden, np.ones((2, 16, 1), np.float32)], -1)
    w = np.concatenate([head, np.full((1, V), offset, np.float32)], 0)
    x32 = np.einsum("bsd,dv->bsv", h, w, dtype=np.float32)  # the float32 logits the loss sees
    want = ce64(x32, targets)
    got, _ = losses.cross_entropy(jnp.asarray(x32), jnp.asarray(targets))
    assert rel_err(got, want) <= 1e-5  # tolerance: float32, 1e-5 relative at any offset
    for tiles, chunk in ((1, None), (4, None), (2, 32)):
        sums = losses.lm_loss(
            jnp.asarray(h), jnp.asarray(w), jnp.asarray(targets), jnp.asarray(weights),
            num_vocab_tiling=tiles, vocab_chunk_size=chunk,
        )  # fmt: skip
        # tolerance: f32 sums of 32 per-token values, 1e-5 relative.
        assert rel_err(sums["loss_sum"], want.sum()) <= 1e-5, (tiles, chunk)


# --------------------------------------------------------------------------- soft loss precision


@pytest.mark.parametrize("noise", [1e-2, 1e-3, 1e-4, 1e-5])
def test_soft_loss_keeps_relative_precision_near_zero(noise):
    rng = np.random.default_rng(4)
    teacher = (rng.standard_normal((4, 32768)) * 3).astype(np.float32)
    student = (teacher + noise * rng.standard_normal(teacher.shape)).astype(np.float32)
    got = losses.soft_loss(jnp.asarray(student), jnp.asarray(teacher), 2.0)
    want = kl64(student, teacher, 2.0)
    assert np.all(np.asarray(got) >= 0)
    # tolerance: 1e-5 relative per token, down to KL ~ 5e-11 (noise 1e-5).
    np.testing.assert_allclose(got, want, rtol=1e-5)
    same = losses.soft_loss(jnp.asarray(teacher), jnp.asarray(teacher), 2.0)
    np.testing.assert_array_equal(same, 0.0)  # tolerance: exact zero for identical logits


def test_soft_loss_gradients_of_all_inputs():
    rng = np.random.default_rng(5)
    student, teacher = rng.normal(size=(2, 3, 40)) * 3, rng.normal(size=(2, 3, 40)) * 3
    w = rng.random((2, 3))

    def f(s, t, temp):
        return jnp.sum(losses.soft_loss(s, t, temp) * w)

    got = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(
        jnp.float32(student), jnp.float32(teacher), jnp.float32(T)
    )
    ls, lt = log_softmax64(student / T), log_softmax64(teacher / T)
    p, q = np.exp(lt), np.exp(ls)
    kl = np.sum(p * (lt - ls), -1, keepdims=True)
    want_s = w[..., None] * T * (q - p)
    want_t = w[..., None] * T * p * (lt - ls - kl)

    def total64(temp):
        return float(np.sum(kl64(student, teacher, temp) * w))

    want_temp = (total64(T + 1e-6) - total64(T - 1e-6)) / 2e-6  # float64 central difference
    assert rel_err(got[0], want_s) <= 1e-5  # tolerance: 1e-5 relative (float32)
    assert rel_err(got[1], want_t) <= 1e-5  # tolerance: 1e-5 relative
    # tolerance: 1e-5 relative (the float64 difference quotient is good to ~1e-9).
    assert rel_err(got[2], want_temp) <= 1e-5


# --------------------------------------------------------------------------- tiled and fused sums


MESHES = {"none": None, "data2_fsdp2_tensor2": (2, 2, 2, 1), "fsdp8": (1, 8, 1, 1)}
CAPS = {"student_softcap": 8.0, "teacher_softcap": 12.0}
Z, EPS = 1e-3, 0.1


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(6)
    return (
        rng.standard_normal((B, S, D)).astype(np.float32),
        (rng.standard_normal((D, V)) / 2).astype(np.float32),
        rng.standard_normal((B, S, E)).astype(np.float32),
        (rng.standard_normal((E, V)) / 2).astype(np.float32),
        rng.integers(0, V, (B, S)).astype(np.int32),
        (rng.uniform(size=(B, S)) > 0.25).astype(np.float32),
    )


def place(mesh, hs, ws, ht, wt, y, w):
    if mesh is None:
        return tuple(jnp.asarray(a) for a in (hs, ws, ht, wt, y, w))
    tok, head = P(("data", "fsdp", "expert"), "sequence"), P("fsdp", "tensor")
    specs = (P(*tok, None), head, P(*tok, None), head, tok, tok)
    arrays = (hs, ws, ht, wt, y, w)
    return tuple(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(arrays, specs))


def make_mesh(name):
    shape = MESHES[name]
    return None if shape is None else jax.make_mesh(with_expert(shape), MESH_AXES)


KEYS = ("loss_sum", "z_loss_sum", "soft_sum")


@functools.cache
def separate(mesh):
    """Reference: untiled lm_loss + soft_loss_sums; sums and grads for cotangents of KEYS."""

    def run(hs, ws, ht, wt, y, w, cts):
        def f(hs, ws, w):
            hard = losses.lm_loss(
                hs, ws, y, w, z_loss_multiplier=Z, label_smoothing=EPS,
                logit_softcap=CAPS["student_softcap"], mesh=mesh,
            )  # fmt: skip
            soft = losses.soft_loss_sums(hs, ws, ht, wt, y, w, temperature=T, mesh=mesh, **CAPS)
            sums = {**hard, **soft}
            return sum(c * sums[k] for c, k in zip(cts, KEYS)), sums

        return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(hs, ws, w)

    return jax.jit(run)


@functools.cache
def fused(mesh, tiles, chunk, with_coefficients, schedule="auto"):
    def run(hs, ws, ht, wt, y, w, cts):
        def f(hs, ws, w):
            sums = losses.distill_loss_sums(
                hs, ws, ht, wt, y, w, temperature=T, z_loss_multiplier=Z, label_smoothing=EPS,
                num_vocab_tiling=tiles, vocab_chunk_size=chunk, mesh=mesh, schedule=schedule,
                coefficients=(cts[0], cts[2]) if with_coefficients else None, **CAPS,
            )  # fmt: skip
            if with_coefficients:
                return sums["objective_sum"], sums
            return sum(c * sums[k] for c, k in zip(cts, KEYS)), sums

        return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(hs, ws, w)

    return jax.jit(run)


def assert_same(got, want, keys):
    (value, sums), grads = got
    (ref_value, ref_sums), ref_grads = want
    assert rel_err(value, ref_value) <= 1e-5  # tolerance: 1e-5 relative (float32)
    for k in keys:
        assert rel_err(sums[k], ref_sums[k]) <= 1e-5, k  # tolerance: 1e-5 relative
    for name, g, r in zip(("hidden", "head", "weights"), grads, ref_grads):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        assert rel_err(g, r) <= 1e-5, name  # tolerance: 1e-5 relative (float32)


ALL_SUMS = (*KEYS, "weight_sum", "teacher_loss_sum")
TILINGS = {"untiled": (1, None), "tiled": (4, None), "vocab_chunked": (2, 32)}


@pytest.mark.parametrize("tiling", list(TILINGS))
@pytest.mark.parametrize("mesh_name", ["none", "data2_fsdp2_tensor2"])
def test_fused_exact_mode_matches_separate_calls(data, mesh_name, tiling):
    mesh = make_mesh(mesh_name)
    args = place(mesh, *data)
    # Every cotangent reaches the gradients: hard, z-term (recomputed) and soft.
    cts = (jnp.float32(0.5), jnp.float32(2.0), jnp.float32(1.5))
    want = separate(mesh)(*args, cts)
    assert_same(fused(mesh, *TILINGS[tiling], False)(*args, cts), want, ALL_SUMS)


@pytest.mark.parametrize("tiling", list(TILINGS))
@pytest.mark.parametrize("mesh_name", ["none", "fsdp8"])
def test_fused_coefficient_mode_matches_separate_calls(data, mesh_name, tiling):
    mesh = make_mesh(mesh_name)
    args = place(mesh, *data)
    cts = (jnp.float32(1.0), jnp.float32(0.0), jnp.float32(0.7))
    want = separate(mesh)(*args, cts)
    got = fused(mesh, *TILINGS[tiling], True)(*args, cts)
    assert_same(got, want, ALL_SUMS)


@pytest.mark.parametrize("tiling", list(TILINGS))
def test_tiled_soft_loss_matches_untiled(data, tiling):
    mesh = make_mesh("data2_fsdp2_tensor2")
    hs, ws, ht, wt, y, w = place(mesh, *data)

    @functools.partial(jax.jit, static_argnums=(0, 1))
    def run(tiles, chunk, hs, ws):
        def f(hs, ws):
            out = losses.soft_loss_sums(
                hs, ws, ht, wt, y, w, temperature=T, num_vocab_tiling=tiles,
                vocab_chunk_size=chunk, mesh=mesh, **CAPS,
            )  # fmt: skip
            return out["soft_sum"], out

        return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(hs, ws)

    (_, got), got_grads = run(*TILINGS[tiling], hs, ws)
    (_, want), want_grads = run(1, None, hs, ws)
    for k in want:
        assert rel_err(got[k], want[k]) <= 1e-5, k  # tolerance: 1e-5 relative (float32)
    for g, r in zip(got_grads, want_grads):
        assert rel_err(g, r) <= 1e-5  # tolerance: 1e-5 relative (float32)


@pytest.mark.parametrize("tiles", [1, 4])
def test_coefficient_mode_poisons_other_gradients(data, tiles):
    hs, ws, ht, wt, y, w = place(None, *data)

    def grad_of(key):
        def f(hs):
            sums = losses.distill_loss_sums(
                hs, ws, ht, wt, y, w, temperature=T, num_vocab_tiling=tiles,
                z_loss_multiplier=Z, coefficients=(1.0, 0.5),
            )  # fmt: skip
            return sums[key]

        return jax.grad(f)

    # One program for every key's gradient (as the step jits them), not one per eager grad.
    grads = jax.jit(lambda hs: {key: grad_of(key)(hs) for key in ("objective_sum", *KEYS)})(hs)
    assert np.all(np.isfinite(grads["objective_sum"]))
    for key in KEYS:
        assert np.all(np.isnan(grads[key])), key  # loud, never silently wrong


@pytest.mark.parametrize("with_coefficients", [False, True])
@pytest.mark.parametrize("mesh_name", ["none", "data2_fsdp2_tensor2"])
def test_row_blocks_give_the_whole_chunks_results(data, mesh_name, with_coefficients):
    """The cpu_blocked schedule cuts chunks smaller and runs their element-wise work in row
    blocks: the same sums and gradients as whole chunks."""
    mesh = make_mesh(mesh_name)
    args = place(mesh, *data)
    cts = (jnp.float32(0.5), jnp.float32(2.0), jnp.float32(1.5))
    if with_coefficients:
        cts = (jnp.float32(1.0), jnp.float32(0.0), jnp.float32(0.7))
    # 2 KiB of float32 logits per chunk and 512 B per block: 4 rows and 1 of the whole
    # vocabulary (a chunk of 32 rows cut in 8), 8 rows (the whole chunk) and 2 of a tensor shard.
    rows, vocab = (128, V) if mesh is None else (32, V // 2)
    blocked = schedule.choose(CpuBlocked(1 << 11, 1 << 9), "cpu", rows, 4, vocab, None)
    assert (blocked.chunk, blocked.block) == ((4, 1) if mesh is None else (8, 2))
    assert schedule.choose("whole", "cpu", rows, 4, vocab, None).chunk == rows // 4
    make_run = functools.partial(fused.__wrapped__, mesh, 4, None, with_coefficients)
    blocked, whole = blocked_and_whole(make_run, *args, cts)
    for a, b in zip(jax.tree.leaves(blocked), jax.tree.leaves(whole)):
        # tolerance: 1e-6 relative; the same float32 operations per row, but XLA may vectorise
        # a row's reduction differently at another block shape (a few ulp).
        assert rel_err(a, b) <= 1e-6


# --------------------------------------------------------------------------- awkward row counts


@pytest.mark.parametrize("vocab", [32768, 131072])
@pytest.mark.parametrize("rows", [3000, 4000, 4099])
def test_cpu_blocks_have_no_cliff_at_awkward_row_counts(rows, vocab):
    """Chunks and blocks are sized for the logits' bytes, not for what divides the rows: the
    loop runs at most one chunk more than the fewest chunks of the target size."""
    target = (32 << 20) // (4 * vocab)  # rows of 32 MiB of float32 logits
    plan = schedule.choose("cpu_blocked", "cpu", rows, 1, vocab, None)
    assert plan.chunk == target and plan.block == (1 << 20) // (4 * vocab)
    assert plan.num_chunks == -(-rows // target) and plan.padding < plan.chunk
    # num_vocab_tiling still bounds a chunk: four chunks of 750 (or 1000) rows at most.
    tiled = schedule.choose("cpu_blocked", "cpu", rows - rows % 4, 4, vocab, None)
    assert tiled.chunk <= (rows - rows % 4) // 4 and tiled.chunk % tiled.block == 0


def test_auto_is_whole_off_cpu_and_the_vocabulary_chunks_win():
    assert schedule.choose("auto", "tpu", 4096, 4, 32768, None).kind == "whole"
    assert schedule.choose("auto", "cpu", 4096, 4, 32768, None).kind == "cpu_blocked"
    assert schedule.choose("auto", "cpu", 4096, 4, 32768, 4096).kind == "vocab"
    with pytest.raises(ValueError, match="vocab_chunk_size=4096"):
        schedule.choose("cpu_blocked", "cpu", 4096, 4, 32768, 4096)
    with pytest.raises(ValueError, match="allowed: auto, whole, cpu_blocked"):
        schedule.choose("blocked", "cpu", 4096, 4, 32768, None)


def awkward_lm(rows: int, vocab: int, plan):
    """The LM loss in 2 chunks (value and gradients) on one device, [1, rows] tokens, in schedule
    `plan`, and its arguments."""

    def f(hs, ws, w):
        out = losses.lm_loss(
            hs, ws, y, w, z_loss_multiplier=1e-3, num_vocab_tiling=2, schedule=plan
        )
        return out["loss_sum"], out

    rng = np.random.default_rng(5)
    hs = jnp.asarray(rng.standard_normal((1, rows, D)), jnp.float32)
    ws = jnp.asarray(rng.standard_normal((D, vocab)) / 4, jnp.float32)
    y = jnp.asarray(rng.integers(0, vocab, (1, rows)), jnp.int32)
    w = jnp.asarray(rng.random((1, rows)) < 0.9, jnp.float32)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)), (hs, ws, w)


def test_a_padded_last_chunk_gives_the_whole_chunks_results():
    """3,000 rows in blocked chunks of 256 rows (the last padded with copies at weight 0): the
    sums and gradients of whole chunks."""
    rows, vocab = 3000, 256
    sizes = CpuBlocked(chunk_bytes=256 * 4 * vocab, block_bytes=8 * 4 * vocab)
    plan = schedule.choose(sizes, "cpu", rows, 2, vocab, None)
    assert (plan.chunk, plan.block, plan.num_chunks, plan.padding) == (256, 8, 12, 72)
    run, args = awkward_lm(rows, vocab, sizes)
    (value, sums), grads = run(*args)
    run, args = awkward_lm(rows, vocab, "whole")
    (ref_value, ref_sums), ref_grads = run(*args)
    assert rel_err(value, ref_value) <= 1e-6  # tolerance: 1e-6, float32 sums in another order
    for k in ref_sums:
        assert rel_err(sums[k], ref_sums[k]) <= 1e-6, k  # tolerance: as above
    for g, r in zip(grads, ref_grads, strict=True):
        assert g.shape == r.shape
        assert rel_err(g, r) <= 1e-6  # tolerance: as above, per gradient


@pytest.mark.parametrize("rows", [3000, 4000])
def test_blocked_memory_at_awkward_rows_is_bounded_by_the_chunk_not_the_rows(rows):
    """At V = 32k, XLA's compiled temporaries of the blocked loss stay at the chunks' size for
    3,000 and 4,000 rows, far under the whole schedule's [rows / 2, V] chunk logits."""
    vocab = 32768

    def temp(plan):
        run, args = awkward_lm(rows, vocab, plan)
        return run.lower(*args).compile().memory_analysis().temp_size_in_bytes

    whole, blocked = temp("whole"), temp("cpu_blocked")
    chunk_logits = 4 * (rows // 2) * vocab  # float32 logits of one of the 2 whole chunks
    assert whole >= chunk_logits
    assert blocked <= whole / 4


# --------------------------------------------------------------------------- argument checks


def test_settings_are_checked(data):
    hs, ws, ht, wt, y, w = place(None, *data)
    x = jnp.zeros((2, 5))
    for z in (float("nan"), float("inf"), -1e-4):
        with pytest.raises(ValueError, match="z_loss_multiplier"):
            losses.cross_entropy(x, jnp.zeros(2, jnp.int32), z_loss_multiplier=z)
    for eps in (float("nan"), 1.0, -0.1):
        with pytest.raises(ValueError, match="label_smoothing"):
            losses.lm_loss(hs, ws, y, w, label_smoothing=eps)
    for t in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            losses.soft_loss(x, x, t)
        with pytest.raises(ValueError, match="temperature"):
            losses.soft_loss_sums(hs, ws, ht, wt, y, w, temperature=t)
    with pytest.raises(ValueError, match="logit_softcap"):
        losses.lm_loss(hs, ws, y, w, logit_softcap=-3.0)


def test_out_of_range_targets(data):
    hs, ws, _, _, y, w = place(None, *data)
    bad = y.at[1, 2].set(V)
    with pytest.raises(ValueError, match=rf"targets_BS: target id {V} at position \(1, 2\)"):
        losses.lm_loss(hs, ws, bad, w.at[1, 2].set(1.0))
    # Weight 0 (padding, ignore-index) stays allowed and changes nothing.
    padded = w.at[1, 2].set(0.0)
    ignored = y.at[1, 2].set(-100)
    for tiles in (1, 4):
        a = losses.lm_loss(hs, ws, ignored, padded, num_vocab_tiling=tiles)
        b = losses.lm_loss(hs, ws, y, padded, num_vocab_tiling=tiles)
        assert rel_err(a["loss_sum"], b["loss_sum"]) <= 1e-6  # tolerance: same tokens, f32
    # Under jit the values are unknown at trace time: the loss becomes NaN, so the trainer's
    # non-finite-step check skips the step.
    for tiles in (1, 4):
        f = jax.jit(functools.partial(losses.lm_loss, num_vocab_tiling=tiles))
        assert np.isnan(f(hs, ws, bad, w.at[1, 2].set(1.0))["loss_sum"])


def test_vocabulary_not_dividing_the_shards_is_refused():
    mesh = jax.make_mesh(with_expert((1, 1, 8, 1)), MESH_AXES)
    hs, ws = jnp.zeros((8, 4, D)), jnp.zeros((D, 100))
    y, w = jnp.zeros((8, 4), jnp.int32), jnp.ones((8, 4))
    with pytest.raises(ValueError, match=r"head_DV: vocabulary 100 does not split into the 8"):
        losses.lm_loss(hs, ws, y, w, num_vocab_tiling=2, mesh=mesh)


# --------------------------------------------------------------------------- features, balance


def test_cosine_feature_loss_has_a_bounded_gradient_at_tiny_norms():
    rng = np.random.default_rng(7)
    t = jnp.asarray(rng.standard_normal((1, 1, 1, 32)), jnp.float32)
    direction = jnp.asarray(rng.standard_normal((1, 1, 1, 32)), jnp.float32)
    direction = direction / jnp.linalg.norm(direction)

    def loss(s):
        return jnp.sum(losses.feature_loss(s, t, "cosine"))

    value_and_grad = jax.jit(jax.value_and_grad(loss))  # one program for the three points
    for s in (jnp.zeros_like(t), 1e-4 * direction, direction):
        value, grad = value_and_grad(s)
        assert np.isfinite(value) and np.all(np.isfinite(grad))
        # tolerance: the clamp at |x| = 1e-3 bounds the gradient by 1e3 (plus f32 rounding).
        assert np.linalg.norm(np.asarray(grad, np.float64)) <= 1e3 * (1 + 1e-5)
    # At norms >= 1e-3 it is the exact cosine distance.
    s, tt = np.asarray(direction, np.float64)[0, 0, 0], np.asarray(t, np.float64)[0, 0, 0]
    want = 1 - s @ tt / (np.linalg.norm(s) * np.linalg.norm(tt))
    np.testing.assert_allclose(float(value), want, rtol=1e-5)  # f32: 1e-5 relative


def test_beta_weights_the_feature_term_under_dynamic_balance():
    h, s, f = 6.0, 0.5, 0.25
    _, scales0 = losses.distillation_loss(h, s, f, alpha=0.5, beta=0.0, balance="dynamic")
    np.testing.assert_allclose(float(scales0["kd_mag_scale"]), h / s, rtol=1e-6)  # kd = soft
    _, scales1 = losses.distillation_loss(h, s, f, alpha=0.5, beta=1.0, balance="dynamic")
    np.testing.assert_allclose(float(scales1["kd_mag_scale"]), h / (2 * s), rtol=1e-6)
    grad = jax.grad(
        lambda f: losses.distillation_loss(h, s, f, alpha=0.5, beta=0.0, balance="dynamic")[0]
    )(f)
    assert float(grad) == 0.0  # beta = 0: the feature loss is off


def test_kd_scale_is_capped():
    # A student near its teacher: kd ~ 1e-8, hard ~ 2 -> uncapped scale 2e8.
    h, s = 2.0, 1e-8

    def total(soft):
        kw = {"alpha": 0.5, "beta": 0.0, "balance": "dynamic", "max_kd_scale": 100.0}
        return losses.distillation_loss(h, soft, 0.0, **kw)[0]

    _, scales = losses.distillation_loss(
        h, s, 0.0, alpha=0.5, beta=0.0, balance="dynamic", max_kd_scale=100.0
    )
    assert float(scales["kd_mag_scale"]) == 100.0
    np.testing.assert_allclose(float(jax.grad(total)(s)), 0.5 * 100.0, rtol=1e-6)  # alpha * cap
    for cap in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="max_kd_scale"):
            losses.distillation_loss(h, s, 0.0, alpha=0.5, beta=0.0, balance="dynamic", max_kd_scale=cap)  # fmt: skip


def test_config_max_kd_scale_is_validated():
    assert config_from_dict({}).distillation.max_kd_scale == 100.0
    with pytest.raises(KilnError, match="max_kd_scale"):
        config_from_dict({"distillation": {"max_kd_scale": 0.0}})
