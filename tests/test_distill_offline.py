"""Offline distillation from a teacher's stored top-k logits: with K = V the online soft loss
(tiled and untiled, 1 and 8 devices); with K < V the tail-bucket and renormalised formulas
against float64 references; the distillation objective without a teacher model."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import blocked_and_whole, make_config, with_expert
from kiln import losses
from kiln.config import MESH_AXES
from kiln.distill import online as distill
from kiln.errors import KilnError
from kiln.losses import TopK
from kiln.parallel.mesh import make_mesh
from kiln.training import train
from kiln.training.batches import BATCH_KEYS

AXES = ("data", "fsdp", "tensor", "sequence")  # meshes add expert=1
TILINGS = {"untiled": (1, None), "tiled": (4, None), "vocab_chunked": (2, 32)}
CAPS = {"student_softcap": 8.0, "teacher_softcap": 12.0}


def rel_err(actual, expected) -> float:
    """Largest absolute error relative to the largest reference magnitude."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = np.max(np.abs(expected))
    return float(np.max(np.abs(actual - expected)) / (scale if scale > 0 else 1.0))


def log_softmax64(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def store(teacher_logits, k, t):
    """What `kiln teacher-logits` keeps: top-k values and ids, and lse(teacher / T) (float64 -> 32)."""
    x = np.asarray(teacher_logits, np.float32)
    ids = np.argsort(-x, axis=-1, kind="stable")[..., :k].astype(np.int32)
    a = x.astype(np.float64) / t
    m = a.max(-1)
    lse = m + np.log(np.exp(a - m[..., None]).sum(-1))
    return TopK(np.take_along_axis(x, ids, -1), ids, lse.astype(np.float32))


def top_k_kl64(student, top: TopK, t, renormalize=False):
    """float64 per-token soft loss of the documented formula and its gradient w.r.t. the student."""
    vocab, k = student.shape[-1], top.ids.shape[-1]
    ids = np.asarray(top.ids)
    b = np.asarray(student, np.float64) / t
    log_q = log_softmax64(b)
    in_top = np.zeros(b.shape, bool)
    np.put_along_axis(in_top, ids, True, -1)
    if renormalize:
        log_p = log_softmax64(np.asarray(top.values, np.float64) / t)
        log_qk = log_softmax64(np.take_along_axis(b, ids, -1))
        kl = np.sum(np.exp(log_p) * (log_p - log_qk), -1)
        grad = np.zeros(b.shape)
        np.put_along_axis(grad, ids, np.exp(log_qk) - np.exp(log_p), -1)
        return t * t * kl, t * grad
    log_p = np.asarray(top.values, np.float64) / t - np.asarray(top.lse, np.float64)[..., None]
    p = np.exp(log_p)
    p_tail = np.zeros(p.shape[:-1]) if k == vocab else np.maximum(1.0 - p.sum(-1), 0.0)
    q = np.exp(log_q)
    q_tail = np.where(in_top, 0.0, q).sum(-1)
    kl = np.sum(p * (log_p - np.take_along_axis(log_q, ids, -1)), -1)
    some = p_tail > 0
    safe_p, safe_q = np.where(some, p_tail, 1.0), np.where(some, q_tail, 1.0)
    kl = kl + np.where(some, p_tail * (np.log(safe_p) - np.log(safe_q)), 0.0)
    r = np.zeros(b.shape)
    np.put_along_axis(r, ids, p, -1)
    r = np.where(in_top, r, (p_tail / np.where(q_tail > 0, q_tail, 1.0))[..., None] * q)
    mass = p.sum(-1) + p_tail
    return t * t * kl, t * (mass[..., None] * q - r)


# --------------------------------------------------------------------------- K = V is the online loss

B, S, D, E, V = 8, 16, 16, 24, 128
T = 1.7
MESHES = {"1 device": None, "8 devices": (2, 2, 2, 1)}


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(6)
    hs = rng.standard_normal((B, S, D)).astype(np.float32)
    ws = (rng.standard_normal((D, V)) / 2).astype(np.float32)
    ht = rng.standard_normal((B, S, E)).astype(np.float32)
    wt = (rng.standard_normal((E, V)) / 2).astype(np.float32)
    y = rng.integers(0, V, (B, S)).astype(np.int32)
    w = (rng.uniform(size=(B, S)) > 0.25).astype(np.float32)
    x_t = np.asarray(
        losses.logits(jnp.asarray(ht), jnp.asarray(wt), softcap=CAPS["teacher_softcap"])
    )
    return hs, ws, ht, wt, y, w, store(x_t, V, T)


def place(mesh, *arrays):
    """Student hidden, head, teacher hidden, head, targets, weights, top-k: tokens and vocabulary sharded."""
    if mesh is None:
        return jax.tree.map(jnp.asarray, arrays)
    tok, head = P(("data", "fsdp", "expert"), "sequence"), P("fsdp", "tensor")
    specs = (
        P(*tok, None),
        head,
        P(*tok, None),
        head,
        tok,
        tok,
        TopK(P(*tok, None), P(*tok, None), tok),
    )
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), arrays, specs)


KEYS = ("loss_sum", "z_loss_sum", "soft_sum")
CTS = (0.5, 2.0, 1.5)  # cotangents of KEYS: every one reaches the gradients


@functools.cache
def online(mesh):
    """Reference: the online fused hard + soft sums, untiled, with the full teacher."""

    def run(hs, ws, ht, wt, y, w, cts):
        def f(hs, ws):
            sums = losses.distill_loss_sums(
                hs, ws, ht, wt, y, w, temperature=T, z_loss_multiplier=1e-3, mesh=mesh, **CAPS
            )
            return sum(c * sums[k] for c, k in zip(cts, KEYS)), sums

        return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(hs, ws)

    return jax.jit(run)


@functools.cache
def offline(mesh, tiles, chunk, coefficients=False, schedule="auto"):
    def run(hs, ws, top, y, w, cts):
        def f(hs, ws):
            sums = losses.top_k_distill_loss_sums(
                hs, ws, top, y, w, temperature=T, z_loss_multiplier=1e-3, mesh=mesh,
                num_vocab_tiling=tiles, vocab_chunk_size=chunk, schedule=schedule,
                student_softcap=CAPS["student_softcap"],
                coefficients=(cts[0], cts[2]) if coefficients else None,
            )  # fmt: skip
            if coefficients:
                return sums["objective_sum"], sums
            return sum(c * sums[k] for c, k in zip(cts, KEYS)), sums

        return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(hs, ws)

    return jax.jit(run)


def assert_same(got, want, keys):
    (value, sums), grads = got
    (ref_value, ref), ref_grads = want
    assert float(ref["soft_sum"]) > 10.0  # a KL far from 0: relative errors mean something
    assert rel_err(value, ref_value) <= 1e-5  # tolerance: 1e-5 relative (float32)
    for k in keys:
        assert rel_err(sums[k], ref[k]) <= 1e-5, k  # tolerance: 1e-5 relative (float32)
    for g, r in zip(grads, ref_grads):
        assert g.shape == r.shape and g.dtype == r.dtype
        assert rel_err(g, r) <= 1e-5  # tolerance: 1e-5 relative (float32)


def mesh_of(devices):
    return (
        None if MESHES[devices] is None else jax.make_mesh(with_expert(MESHES[devices]), MESH_AXES)
    )


@pytest.mark.parametrize(
    ("devices", "tiling"),
    [
        ("1 device", "untiled"),
        ("1 device", "vocab_chunked"),
        ("8 devices", "untiled"),
        ("8 devices", "tiled"),
    ],
)
def test_all_logits_stored_is_the_online_soft_loss(data, devices, tiling):
    mesh = mesh_of(devices)
    hs, ws, ht, wt, y, w, top = place(mesh, *data)
    want = online(mesh)(hs, ws, ht, wt, y, w, CTS)
    got = offline(mesh, *TILINGS[tiling])(hs, ws, top, y, w, CTS)
    assert_same(got, want, (*KEYS, "weight_sum"))
    # Every target is among the V stored ids, and no mass is left for a tail.
    sums = got[0][1]
    assert float(sums["teacher_top_k_hit_sum"]) == float(sums["weight_sum"])
    assert float(sums["teacher_tail_mass_sum"]) == 0.0


@pytest.mark.parametrize("devices", list(MESHES))
def test_top_k_rows_in_blocks_give_the_whole_chunks_results(data, devices):
    """The stored top-k rows are cut with the logits when the element-wise work runs in blocks."""
    mesh = mesh_of(devices)
    hs, ws, _, _, y, w, top = place(mesh, *data)
    # Chunks of 4 rows in blocks of 1 (on 8 devices the whole 8-row chunk, in blocks of 2 rows
    # of a tensor shard) against the whole chunk.
    make_run = functools.partial(offline.__wrapped__, mesh, 4, None, False)
    blocked, whole = blocked_and_whole(make_run, hs, ws, top, y, w, CTS)
    for a, b in zip(jax.tree.leaves(blocked), jax.tree.leaves(whole)):
        # tolerance: 1e-6 relative; the same float32 operations per row, but XLA may
        # vectorise a row's reduction differently at another block shape (a few ulp).
        assert rel_err(a, b) <= 1e-6


def test_coefficient_mode_is_the_online_gradient_of_the_combination(data):
    mesh = mesh_of("8 devices")
    hs, ws, ht, wt, y, w, top = place(mesh, *data)
    cts = (0.5, 0.0, 1.5)  # objective_sum = 0.5 loss_sum + 1.5 soft_sum
    want = online(mesh)(hs, ws, ht, wt, y, w, cts)
    assert_same(offline(mesh, 2, 32, coefficients=True)(hs, ws, top, y, w, cts), want, KEYS)


# --------------------------------------------------------------------------- K < V: the formulas

V_BIG, K_BIG, T_BIG = 8192, 64, 2.0


@pytest.fixture(scope="module")
def big():
    """A peaked, LM-like teacher (logits fall with log rank) over V = 8192 and a random student."""
    rng = np.random.default_rng(11)
    b, s, d = 2, 16, 32
    rank = np.argsort(rng.random((b, s, V_BIG)), axis=-1)
    teacher = (-2.5 * np.log1p(rank) + 0.3 * rng.standard_normal((b, s, V_BIG))).astype(np.float32)
    top = store(teacher, K_BIG, T_BIG)
    # Rows whose stored values overshoot their lse by 1% (sum p_i = 1.01, as rounding can make
    # it exceed 1): p_tail clamps at 0 and M = sum p_i.
    p_top = np.exp(top.values / T_BIG - top.lse[..., None].astype(np.float64)).sum(-1)
    lowered = np.where(np.arange(s) % 4 == 0, np.log(p_top) - 0.01, 0.0)
    top = TopK(top.values, top.ids, (top.lse + lowered).astype(np.float32))
    hs = rng.standard_normal((b, s, d)).astype(np.float32)
    ws = (rng.standard_normal((d, V_BIG)) / 2).astype(np.float32)
    y = rng.integers(0, V_BIG, (b, s)).astype(np.int32)
    w = rng.uniform(0.5, 1.0, (b, s)).astype(np.float32)
    return teacher, top, hs, ws, y, w


def test_tail_bucket_is_what_separates_offline_from_online(big):
    teacher, top, hs, ws, _, _ = big
    student = np.asarray(losses.logits(jnp.asarray(hs), jnp.asarray(ws)))
    p = np.exp(log_softmax64(teacher / T_BIG))
    tail_mass = 1.0 - np.take_along_axis(p, top.ids, -1).sum(-1)
    assert tail_mass.min() > 0.01 and tail_mass.max() < 0.6  # the bucket matters here
    lowered = np.arange(top.lse.shape[-1]) % 4 == 0
    over = np.exp(top.values / T_BIG - top.lse[..., None]).sum(-1) > 1.0
    assert over[:, lowered].all() and not over[:, ~lowered].any()  # both branches of p_tail
    got = jax.jit(losses.top_k_soft_loss)(jnp.asarray(student), TopK(*map(jnp.asarray, top)), T_BIG)
    want, _ = top_k_kl64(student, top, T_BIG)
    np.testing.assert_allclose(got, want, rtol=1e-5)  # tolerance: float32, 1e-5 relative
    # Online minus offline is the KL inside the tail, minus its bucket's (log-sum inequality:
    # >= 0). On rows with their true lse the offline loss is the formula with exact p.
    on = np.asarray(jax.jit(losses.soft_loss)(jnp.asarray(student), jnp.asarray(teacher), T_BIG))
    log_q = log_softmax64(student / T_BIG)
    in_top = np.zeros(p.shape, bool)
    np.put_along_axis(in_top, top.ids, True, -1)
    q_tail = np.where(in_top, 0.0, np.exp(log_q)).sum(-1)
    inside = np.where(in_top, 0.0, p * (np.log(p) - log_q)).sum(-1)
    gap = T_BIG**2 * (inside - tail_mass * (np.log(tail_mass) - np.log(q_tail)))
    assert gap[:, ~lowered].min() > 1e-3
    # tolerance: each KL is good to 1e-5 of itself, so the gap to 1e-5 of the online KL.
    np.testing.assert_allclose(
        (on - got)[:, ~lowered], gap[:, ~lowered], rtol=0, atol=1e-5 * on.max()
    )


@pytest.mark.parametrize("renormalize", [False, True], ids=["tail_bucket", "renormalized"])
def test_top_k_loss_and_gradient_match_float64(big, renormalize):
    _teacher, top, hs, ws, _, _ = big
    student = np.asarray(losses.logits(jnp.asarray(hs), jnp.asarray(ws)))
    want, want_grad = top_k_kl64(student, top, T_BIG, renormalize)
    cts = np.random.default_rng(3).uniform(0.5, 1.5, want.shape)

    def f(x):
        loss = losses.top_k_soft_loss(
            x, TopK(*map(jnp.asarray, top)), T_BIG, renormalize=renormalize
        )
        return jnp.sum(loss * cts), loss

    grad, got = jax.jit(jax.grad(f, has_aux=True))(jnp.asarray(student))
    np.testing.assert_allclose(got, want, rtol=1e-5)  # tolerance: float32, 1e-5 relative
    assert rel_err(grad, cts[..., None] * want_grad) <= 1e-5  # tolerance: 1e-5 relative


@pytest.mark.parametrize(
    ("tiling", "renormalize"),
    [((4, None), False), ((2, 1024), True)],
    ids=["tiled-tail_bucket", "vocab_chunked-renormalized"],
)
def test_tiled_top_k_sums_match_float64_on_8_devices(big, tiling, renormalize):
    _, top, hs, ws, y, w = big
    cap = CAPS["student_softcap"]
    mesh = jax.make_mesh(with_expert((1, 2, 4, 1)), MESH_AXES)
    tok = P(("data", "fsdp", "expert"), "sequence")
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    args = (put(hs, P(*tok, None)), put(ws, P("fsdp", "tensor")))
    top_d = TopK(put(top.values, P(*tok, None)), put(top.ids, P(*tok, None)), put(top.lse, tok))

    @jax.jit
    def run(hs, ws, top, y, w):
        def f(hs, ws):
            sums = losses.top_k_distill_loss_sums(
                hs, ws, top, y, w, temperature=T_BIG, renormalize=renormalize, student_softcap=cap,
                num_vocab_tiling=tiling[0], vocab_chunk_size=tiling[1], mesh=mesh,
            )  # fmt: skip
            return sums["soft_sum"], sums

        return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(hs, ws)

    (_, sums), (d_hs, d_ws) = run(*args, top_d, put(y, tok), put(w, tok))
    z = np.einsum("bsd,dv->bsv", hs.astype(np.float64), ws.astype(np.float64))
    x = cap * np.tanh(z / cap)
    want, g = top_k_kl64(x, top, T_BIG, renormalize)
    g = w[..., None] * g * (1.0 - (x / cap) ** 2)  # through the soft-cap
    assert rel_err(sums["soft_sum"], np.sum(w * want)) <= 1e-5  # tolerance: 1e-5 relative
    assert rel_err(d_hs, np.einsum("bsv,dv->bsd", g, ws)) <= 1e-5  # tolerance: 1e-5 relative
    assert rel_err(d_ws, np.einsum("bsd,bsv->dv", hs, g)) <= 1e-5  # tolerance: 1e-5 relative
    hit = (top.ids == y[..., None]).any(-1)
    assert rel_err(sums["teacher_top_k_hit_sum"], np.sum(w * hit)) <= 1e-6  # f32 sum of 32
    p = np.exp(top.values.astype(np.float64) / T_BIG - top.lse[..., None]).sum(-1)
    tail = np.maximum(1.0 - p, 0.0)
    assert rel_err(sums["teacher_tail_mass_sum"], np.sum(w * tail)) <= 1e-5  # f32: 1e-5


# --------------------------------------------------------------------------- the objective

SEQ, BATCH, VOCAB = 8, 8, 128
TEACHER = {"vocab_size": VOCAB, "d_model": 32, "num_layers": 1, "num_heads": 4, "d_ff": 64, "max_seq_len": SEQ}  # fmt: skip
STUDENT = {"vocab_size": VOCAB, "d_model": 16, "num_layers": 1, "num_heads": 2, "d_ff": 32, "max_seq_len": SEQ}  # fmt: skip


def student_config(offline=True, **sections):
    dist = {"alpha": 0.6, "temperature": 2.0, "balance": "dynamic", "max_kd_scale": 1000.0}
    if offline:
        dist["teacher_logits_dir"] = "stored"
    return make_config(
        {
            "model": STUDENT,
            "data": {"seq_len": SEQ, "source": "synthetic"},
            "train": {"global_batch_size": BATCH, "steps": 4, "gradient_accumulation_steps": 2},
            "mesh": {"data": 2, "fsdp": 2, "tensor": 2},
            "loss": {"z_loss_multiplier": 1e-3},
            "distillation": {**dist, **sections.pop("distillation", {})},
        },
        **sections,
    )


@pytest.fixture(scope="module")
def teacher_and_batch():
    """A random teacher, a batch with padding, and the teacher's full logits stored (K = V)."""
    config = make_config({"model": TEACHER, "data": {"seq_len": SEQ}})
    state = train.init_state(config)
    teacher = distill.Teacher(config, "teacher", 0, state.graphdef, state.params, state.rest)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (BATCH, SEQ + 1))
    weights = (np.arange(SEQ)[None, :] < rng.integers(1, SEQ + 1, (BATCH, 1))).astype(np.float32)
    batch = {
        "inputs": tokens[:, :-1].astype(np.int32),
        "targets": tokens[:, 1:].astype(np.int32),
        "positions": np.broadcast_to(np.arange(SEQ), (BATCH, SEQ)).astype(np.int32),
        "segment_ids": (weights > 0).astype(np.int32),
        "weights": weights,
    }

    @jax.jit
    def logits(params, inputs, positions, segment_ids):
        model = teacher.model(params)
        out = model.hidden_states(inputs, positions, segment_ids)
        return losses.logits(out.hidden, model.head_weight())

    x = np.asarray(
        logits(teacher.params, batch["inputs"], batch["positions"], batch["segment_ids"])
    )
    top = store(x, VOCAB, 2.0)
    return teacher, {
        **batch,
        "teacher_values": top.values,
        "teacher_ids": top.ids,
        "teacher_lse": top.lse,
    }


def test_offline_objective_is_the_online_one_with_all_logits_stored(teacher_and_batch):
    teacher, batch = teacher_and_batch
    online_cfg, offline_cfg = student_config(offline=False), student_config()
    mesh = make_mesh(online_cfg)
    state = distill.init_student(online_cfg, mesh, teacher.config)
    plain = {k: batch[k] for k in BATCH_KEYS}
    ref_loss, ref_aux, ref_grads = distill.loss_and_grads(online_cfg, teacher, state, plain)
    objective = distill.DistillObjective.create(offline_cfg, mesh, None)
    assert objective.teacher_params is None  # no teacher parameters in the step
    loss, aux, grads = train.run_objective(objective, state, batch)
    assert rel_err(loss, ref_loss) <= 1e-5  # tolerance: 1e-5 relative (float32)
    for k in ("hard_loss", "soft_loss", "total_loss", "kd_mag_scale"):
        assert rel_err(aux[f"distill/{k}"], ref_aux[f"distill/{k}"]) <= 1e-5, k  # 1e-5 relative
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        assert rel_err(g, r) <= 1e-5  # tolerance: 1e-5 relative (float32)
    assert "distill/teacher_loss" not in aux  # not known from a top-k store
    assert (
        float(aux["distill/teacher_top_k_hit"]) == 1.0
        and float(aux["distill/teacher_tail_mass"]) == 0.0
    )
    assert (
        objective.flops_per_token()
        < distill.DistillObjective.create(online_cfg, mesh, teacher).flops_per_token()
    )


def test_offline_objective_refuses_what_it_cannot_compute():
    with pytest.raises(KilnError, match=r"distillation.layer_map: 1 pairs"):
        distill.DistillObjective.create(
            student_config(distillation={"layer_map": [[0, 1]]}), None, None
        )
    schedule = {"schedule": "linear", "temperature_end": 1.0}
    with pytest.raises(KilnError, match=r"distillation.temperature_end: 1.0"):
        distill.DistillObjective.create(student_config(distillation=schedule), None, None)
