"""Attention implementations against a float64 numpy reference and against kiln's dense path."""

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO, assert_user_error, equations, kiln_main, make_config
from kiln.errors import KilnError
from kiln.model import create_model
from kiln.model.attention import (
    IMPLEMENTATIONS,
    balanced_order,
    causal_attention,
    check,
    cudnn_arguments,
    cudnn_attention,
    dense_attention,
    load_balanced,
    resolve,
    ring_attention,
    ring_work,
    sequence_shards,
    splash_attention,
)
from kiln.model.attention.xla import fold_tables
from kiln.parallel.mesh import batch_sharding, logical_sharding, make_mesh, use_mesh

B, N, K, H = 4, 4, 2, 16  # grouped-query: 2 query heads per key/value head
# Logical names of the model's queries and keys/values entering attention (kiln.model.llama).
HEADS = ("batch", "length", "act_heads", None)
KV_HEADS = ("batch", "length", "act_kv_heads", None)


def rel_err(a, b):
    """max |a - b| / max |b|: a relative error that near-zero entries cannot blow up."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / np.abs(b).max()


def packed_segments(s, seed=0):
    """[B, s] segment ids: 1-3 documents per row, then padding (0) in some rows."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((B, s), np.int32)
    for b in range(B):
        cuts = np.sort(rng.choice(np.arange(1, s - 8), size=b % 3, replace=False))
        end = s - 8 * (b % 2)
        bounds = [0, *cuts, end]
        for i, (lo, hi) in enumerate(itertools.pairwise(bounds)):
            seg[b, lo:hi] = i + 1
    return jnp.asarray(seg)


def inputs(s, seed=0):
    """q [B,s,N,H], k and v [B,s,K,H], packed segment ids, and an output cotangent."""
    kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (B, s, N, H))
    k, v = jax.random.normal(kk, (B, s, K, H)), jax.random.normal(kv, (B, s, K, H))
    return q, k, v, packed_segments(s, seed), jax.random.normal(kc, (B, s, N, H))


def numpy_attention(q, k, v, seg, window=None, sinks=None):
    """float64 reference: per head, softmax over earlier keys of the same segment (the last
    `window` of them), with the head's sink logit in the denominator when given."""
    q, k, v, seg = (np.asarray(x, np.float64) for x in (q, k, v, seg))
    s, g = q.shape[1], N // K
    seen = np.tri(s, dtype=bool) & (np.subtract.outer(np.arange(s), np.arange(s)) < (window or s))
    out = np.zeros_like(q)
    for b in range(B):
        for n in range(N):
            scores = q[b, :, n] @ k[b, :, n // g].T / np.sqrt(H)
            allowed = (seg[b][:, None] == seg[b][None, :]) & seen
            scores = np.where(allowed, scores, -np.inf)
            sink = -np.inf if sinks is None else float(sinks[n])
            top = np.maximum(scores.max(-1, keepdims=True), sink)
            p = np.exp(scores - top)
            out[b, :, n] = (p / (p.sum(-1, keepdims=True) + np.exp(sink - top))) @ v[b, :, n // g]
    return out


def value_and_grads(fn, q, k, v, seg, cot):
    """sum(fn(q, k, v, seg) * cot) and its gradients with respect to q, k and v, jitted."""
    loss = lambda q, k, v: jnp.sum(fn(q, k, v, seg) * cot)  # noqa: E731
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)


def on_mesh(mesh, rules, q, k, v, seg, cot):
    """The inputs placed as the model places them: q and the cotangent by query heads, k and
    v by key/value heads, the segment ids like the batch."""
    q, cot = (jax.device_put(x, logical_sharding(mesh, rules, HEADS)) for x in (q, cot))
    k, v = (jax.device_put(x, logical_sharding(mesh, rules, KV_HEADS)) for x in (k, v))
    return q, k, v, jax.device_put(seg, batch_sharding(mesh, rules)), cot


def assert_equal_values_and_grads(got, want, tol):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert rel_err(g, w) < tol


CAUSAL_CASES = {
    "one_shard": dict(query_block=16, shards=1),
    "two_shards": dict(query_block=16, shards=2),
    "four_shards": dict(query_block=32, shards=4),
}


@pytest.mark.parametrize("case", list(CAUSAL_CASES))
def test_causal_skipping_equals_numpy_and_the_dense_path(case):
    s = 64
    q, k, v, seg, cot = inputs(s)
    fn = lambda *a: causal_attention(*a, **CAUSAL_CASES[case])  # noqa: E731
    # 1e-5 relative: float32 softmax and matmuls against float64.
    assert rel_err(jax.jit(fn)(q, k, v, seg), numpy_attention(q, k, v, seg)) < 1e-5
    got = value_and_grads(fn, q, k, v, seg, cot)
    want = value_and_grads(lambda *a: dense_attention(*a, query_block=16), q, k, v, seg, cot)
    # 1e-5 relative: the same float32 rows; the softmax sums run over tiles (and fewer exactly
    # zero masked terms) in another order.
    assert_equal_values_and_grads(got, want, 1e-5)


def _dot_flops(jaxpr):
    """2 * multiply-adds of every dot_general in a jaxpr; a scan body counts once per step."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2 * np.prod(eqn.outvars[0].aval.shape) * np.prod([lhs[d] for d in contract])
        steps = eqn.params.get("length", 1)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += steps * _dot_flops(inner)
    return total


@pytest.mark.parametrize("shards,fraction", [(1, 9 / 16), (2, 25 / 32)])
def test_causal_skipping_computes_only_tiles_on_or_below_the_diagonal(shards, fraction):
    q, k, v, seg, cot = inputs(64)

    def flops(fn):
        grad = jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v, seg) * cot), (0, 1, 2))
        return _dot_flops(jax.make_jaxpr(fn)(q, k, v, seg).jaxpr), _dot_flops(
            jax.make_jaxpr(grad)(q, k, v).jaxpr
        )

    skip = flops(lambda *a: causal_attention(*a, query_block=16, shards=shards))
    dense = flops(lambda *a: dense_attention(*a, query_block=16))
    # Unsharded: 8 tiles of 8 rows; the 8*9/2 tiles on or below the diagonal of 8*8.
    # Two shards of 8 tiles of 4 rows: 4 steps x 2 shards x (3*8 + 1) products of 16*16.
    assert skip[0] / dense[0] == pytest.approx(fraction, rel=1e-9)
    assert skip[1] / dense[1] == pytest.approx(fraction, rel=1e-9)


def test_one_block_sequences_take_the_dense_computation_bit_for_bit():
    q, k, v, seg, _ = inputs(32)
    got = jax.jit(lambda *a: causal_attention(*a, query_block=32))(q, k, v, seg)
    want = jax.jit(lambda *a: dense_attention(*a, query_block=32))(q, k, v, seg)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "mesh",
    [dict(fsdp=4, sequence=2), dict(fsdp=2, tensor=2, sequence=2), dict(data=2, sequence=4)],
)
def test_causal_skipping_sequence_sharded_equals_unsharded(mesh):
    s = 128
    q, k, v, seg, cot = inputs(s, seed=1)
    want = value_and_grads(lambda *a: dense_attention(*a, query_block=32), q, k, v, seg, cot)
    config = make_config(mesh=mesh)
    mesh_, rules = make_mesh(config), config.mesh.rules
    # Placed as the model places them: queries, keys and values split along the sequence.
    q, k, v, seg, cot = on_mesh(mesh_, rules, q, k, v, seg, cot)
    with use_mesh(mesh_, rules):
        assert sequence_shards() == mesh["sequence"]
        got = value_and_grads(lambda *a: causal_attention(*a, query_block=32), q, k, v, seg, cot)
    # 1e-5 relative: as unsharded; the shards only change which rows a device computes.
    assert_equal_values_and_grads(got, want, 1e-5)


def test_sequence_sharded_skipping_splits_the_work_evenly():
    q, k, v, seg, _ = inputs(128, seed=4)

    def flops(shards):
        def loss(q, k, v):
            return jnp.sum(causal_attention(q, k, v, seg, query_block=32, shards=shards))

        grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        return grad.lower(q, k, v).compile().cost_analysis()["flops"]

    one_device = flops(2)
    config = make_config(mesh=dict(fsdp=4, sequence=2))
    mesh, rules = make_mesh(config), config.mesh.rules
    # Placed as the model places them: queries, keys and values split along the sequence.
    q = jax.device_put(q, logical_sharding(mesh, rules, HEADS))
    kv = logical_sharding(mesh, rules, KV_HEADS)
    k, v = jax.device_put(k, kv), jax.device_put(v, kv)
    seg = jax.device_put(seg, batch_sharding(mesh, rules))
    with use_mesh(mesh, rules):
        per_device = flops(None)
    # Same program on 8 devices (4 batch x 2 sequence shards): each does an eighth of the work.
    # 5%: the partitioner's own ops (sums of partial key/value gradients, index arithmetic)
    # weigh ~2% at this tiny size; work not split over the sequence would be 2x.
    assert per_device * 8 == pytest.approx(one_device, rel=5e-2)


SPLASH_S = 256  # two 128-row kernel blocks: the interpreter is slow


@pytest.fixture(scope="module")
def splash_case():
    q, k, v, seg, cot = inputs(SPLASH_S, seed=2)
    dense = value_and_grads(dense_attention, q, k, v, seg, cot)
    return (q, k, v, seg, cot), dense


def test_splash_interpreted_equals_numpy_and_the_dense_path(splash_case):
    (q, k, v, seg, cot), dense = splash_case
    fn = lambda *a: splash_attention(*a, block=128, interpret=True)  # noqa: E731
    got = value_and_grads(fn, q, k, v, seg, cot)
    # 1e-5 relative: float32 online softmax (flash blocks) vs float64 / vs one-pass softmax.
    assert rel_err(jax.jit(fn)(q, k, v, seg), numpy_attention(q, k, v, seg)) < 1e-5
    assert_equal_values_and_grads(got, dense, 1e-5)


def test_splash_under_shard_map_over_batch_and_heads_with_sequence_sharding(splash_case):
    (q, k, v, seg, cot), dense = splash_case
    config = make_config(mesh=dict(fsdp=2, tensor=2, sequence=2))
    with use_mesh(make_mesh(config), config.mesh.rules):
        got = value_and_grads(
            lambda *a: splash_attention(*a, block=128, interpret=True), q, k, v, seg, cot
        )
    # 1e-5 relative: each device runs the same kernel on its batch rows and heads.
    assert_equal_values_and_grads(got, dense, 1e-5)


def test_splash_on_balanced_sequence_shards_keeps_each_shards_queries(splash_case):
    """Rows placed zigzag over 2 sequence shards (with fsdp and tensor), a window and sinks:
    each shard's kernel takes its own 128 query rows (not the gathered 256) against the 256
    keys put back in order, and the attention equals the dense path's in order."""
    (q, k, v, seg, cot), _ = splash_case
    window = 100
    dense = lambda *a, **kw: dense_attention(*a, window=window, **kw)  # noqa: E731
    want = masked_value_and_grads(dense, q, k, v, seg, cot, SINKS)
    order = balanced_order(SPLASH_S, 2)
    placed = [jnp.take(x, order, axis=1) for x in (q, k, v, seg, cot)]
    config = make_config(mesh=dict(fsdp=2, tensor=2, sequence=2))
    mesh, rules = make_mesh(config), config.mesh.rules
    splash = functools.partial(splash_attention, block=128, interpret=True, window=window)
    with use_mesh(mesh, rules), load_balanced():
        placed = on_mesh(mesh, rules, *placed)
        loss, grads = masked_value_and_grads(splash, *placed[:4], placed[4], SINKS)
        jaxpr = jax.make_jaxpr(splash)(*placed[:4])
    kernel_rows = {  # rows of the kernel's first two float operands: queries and keys
        tuple(x.aval.shape[-2] for x in eqn.invars if x.aval.dtype == jnp.float32)[:2]
        for eqn in equations(jaxpr.jaxpr)
        if eqn.primitive.name == "pallas_call"
    }
    assert kernel_rows == {(SPLASH_S // 2, SPLASH_S)}
    back = np.argsort(order)
    in_order = [jnp.take(g, back, axis=1) for g in grads[:3]] + list(grads[3:])
    # 1e-5 relative: float32 online softmax (flash blocks) against the one-pass softmax; the
    # shards only change which query rows a kernel call computes.
    assert_equal_values_and_grads((loss, in_order), want, 1e-5)


def test_splash_bf16_stays_close_to_the_float32_dense_path(splash_case):
    (q, k, v, seg, _), _ = splash_case
    want = dense_attention(q, k, v, seg)
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    got = jax.jit(lambda *a: splash_attention(*a, seg, block=128, interpret=True))(*bf)
    assert got.dtype == jnp.bfloat16
    # bf16 inputs carry a relative rounding of 2^-9 ~ 2e-3 each (q, k, v and the probabilities
    # before the value matmul); a few of them add up along a row: bound at 2e-2.
    assert rel_err(got, want) < 2e-2


def test_cudnn_mask_arguments_give_kiln_attention_through_jax_xla():
    q, k, v, seg, cot = inputs(64, seed=3)
    args = cudnn_arguments(q, k, v, seg)
    assert args["is_causal"] is True and args["mask"].shape == (B, 1, 64, 64)
    assert args["mask"].dtype == jnp.bool_ and args["scale"] == H**-0.5

    def via_jax(q, k, v, seg):
        return jax.nn.dot_product_attention(**cudnn_arguments(q, k, v, seg), implementation="xla")

    got = value_and_grads(via_jax, q, k, v, seg, cot)
    want = value_and_grads(lambda *a: dense_attention(*a, query_block=16), q, k, v, seg, cot)
    # 1e-5 relative: the same masked float32 softmax, computed by JAX's reference kernel.
    assert_equal_values_and_grads(got, want, 1e-5)


def test_gpu_and_tpu_kernels_refuse_other_platforms_in_one_line():
    q, k, v, seg, _ = inputs(128)
    with pytest.raises(KilnError, match=r"model\.attention: got 'cudnn', .* GPU only") as e:
        cudnn_attention(q, k, v, seg)
    assert "\n" not in str(e.value) and "'cpu'" in str(e.value)
    with pytest.raises(KilnError, match=r"model\.attention: got 'splash', .* TPU only"):
        splash_attention(q, k, v, seg)
    with pytest.raises(KilnError, match=r"'cudnn' needs model\.dtype bfloat16 or float16, got fl"):
        check("cudnn", "gpu", jnp.float32)
    check("cudnn", "gpu", jnp.bfloat16)
    check("splash", "tpu", jnp.float32)
    check("xla", "cpu", jnp.float32)


def test_kiln_train_refuses_a_kernel_of_another_platform_before_writing(tmp_path):
    proc = kiln_main(
        "train",
        REPO / "configs" / "tiny.yaml",
        "model.attention=cudnn",
        f"train.output_dir={tmp_path}",
    )
    assert_user_error(proc, "model.attention: got 'cudnn'", "GPU only", "'cpu'")
    assert list(tmp_path.iterdir()) == []


def test_auto_picks_xla_on_cpu_and_the_model_dispatches_through_the_registry():
    assert resolve("auto", jnp.float32) == "xla" and set(IMPLEMENTATIONS) == {
        "xla",
        "cudnn",
        "splash",
    }
    tiny = dict(vocab_size=128, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2, d_ff=64)
    tokens = jnp.zeros((2, 128), jnp.int32)
    segments = jnp.ones((2, 128), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(128), (2, 128))
    for name, platform in (("cudnn", "GPU"), ("splash", "TPU")):
        config = make_config(model={**tiny, "attention": name}, data={"seq_len": 128})
        model = create_model(config, None, 0)
        with pytest.raises(KilnError, match=f"got '{name}', which runs on {platform} only"):
            jax.eval_shape(model.hidden_states, tokens, positions, segments)


def test_unknown_attention_is_refused_naming_the_choices():
    with pytest.raises(
        KilnError, match=r"model\.attention: got 'flash'; allowed: auto, xla, cudnn, splash"
    ):
        make_config(model={"attention": "flash"})


def assert_transformer_matches_numpy(model: dict, batch: int, seed: int, contexts=("all_gather",)):
    """A Transformer at 1024 tokens (two 512-row query blocks: the skipping path, not the dense
    one), two documents per row, against the float64 reference model (row 3), unsharded and
    on fsdp 4 x sequence 2 (with each of `contexts`); returns its config."""
    from test_model import forward, rebuild, reference

    s = 1024
    model_cfg = dict(vocab_size=128, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64)
    sections = dict(model={**model_cfg, **model, "max_seq_len": s}, data={"seq_len": s})
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, 128, (batch, s)))
    cut = 300 + 50 * np.arange(batch)[:, None]  # two documents per row, no padding
    idx = np.arange(s)[None, :]
    positions = jnp.asarray(np.where(idx < cut, idx, idx - cut), jnp.int32)
    segments = jnp.asarray(np.where(idx < cut, 1, 2), jnp.int32)
    config = make_config(**sections, mesh=dict(fsdp=4, sequence=2))
    model = create_model(config, None, 0)
    unsharded = forward(model, tokens, positions, segments)
    want, _ = reference(model, tokens[3], positions[3], segments[3])
    # 1e-5 relative: float32 model vs float64 reference (as in test_model).
    assert rel_err(unsharded[3], want) < 1e-5
    for context in contexts:
        placed = rebuild(model, config.model.model_copy(update={"context_parallel": context}))
        sharded = forward(placed, tokens, positions, segments, make_mesh(config), config.mesh.rules)
        # 1e-5 relative: the same float32 rows, computed on 8 devices.
        assert rel_err(sharded, unsharded) < 1e-5, context
    return config


def test_transformer_with_skipping_matches_numpy_unsharded_and_sequence_sharded():
    assert_transformer_matches_numpy({"num_layers": 2}, batch=8, seed=5)


# ---------------------------------------------------------------------------------------------
# Sliding windows and attention sinks

SINKS = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)  # one logit per query head (N = 4)


def masked_value_and_grads(fn, q, k, v, seg, cot, sinks):
    """As `value_and_grads`, with the gradient with respect to the sinks too (when given)."""
    if sinks is None:
        return value_and_grads(fn, q, k, v, seg, cot)
    loss = lambda q, k, v, sinks: jnp.sum(fn(q, k, v, seg, sinks_N=sinks) * cot)  # noqa: E731
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, sinks)


@pytest.mark.parametrize(
    ("window", "sinks", "case"),
    [(5, True, "one_shard"), (24, False, "two_shards"), (None, True, "two_shards"), (9, True, "four_shards")],
    ids=["window5-sinks-one_shard", "window24-two_shards", "sinks-two_shards", "window9-sinks-four_shards"],
)  # fmt: skip
def test_windows_and_sinks_equal_numpy_and_the_dense_path(window, sinks, case):
    q, k, v, seg, cot = inputs(64, seed=6)
    sinks = SINKS if sinks else None
    fn = lambda *a, **kw: causal_attention(*a, **CAUSAL_CASES[case], window=window, **kw)  # noqa: E731
    dense = lambda *a, **kw: dense_attention(*a, query_block=16, window=window, **kw)  # noqa: E731
    want = numpy_attention(q, k, v, seg, window, sinks)
    # 1e-5 relative: float32 softmax and matmuls against float64.
    assert rel_err(jax.jit(functools.partial(fn, sinks_N=sinks))(q, k, v, seg), want) < 1e-5
    assert rel_err(jax.jit(functools.partial(dense, sinks_N=sinks))(q, k, v, seg), want) < 1e-5
    got = masked_value_and_grads(fn, q, k, v, seg, cot, sinks)
    # 1e-5 relative: the same float32 rows, summed over tiles in another order.
    assert_equal_values_and_grads(
        got, masked_value_and_grads(dense, q, k, v, seg, cot, sinks), 1e-5
    )


def test_a_window_skips_the_key_tiles_before_it():
    """64 rows in 8 tiles of 8: a window of 8 keys reaches into the tile before a query's own,
    so each step's low and high query tiles read 2 key tiles each (the first tile 1, padded):
    16 tile products of the 64 dense ones, against the causal 36 (+ padding)."""
    q, k, v, seg, _ = inputs(64)

    def flops(fn):
        return _dot_flops(jax.make_jaxpr(fn)(q, k, v, seg).jaxpr)

    windowed = flops(lambda *a: causal_attention(*a, query_block=16, window=8))
    dense = flops(lambda *a: dense_attention(*a, query_block=16))
    assert windowed / dense == pytest.approx(16 / 64, rel=1e-9)


def test_windows_and_sinks_sequence_sharded_equal_unsharded():
    s, window = 128, 40
    q, k, v, seg, cot = inputs(s, seed=7)
    dense = lambda *a, **kw: dense_attention(*a, query_block=32, window=window, **kw)  # noqa: E731
    want = masked_value_and_grads(dense, q, k, v, seg, cot, SINKS)
    config = make_config(mesh=dict(fsdp=2, tensor=2, sequence=2))
    mesh_, rules = make_mesh(config), config.mesh.rules
    q, k, v, seg, cot = on_mesh(mesh_, rules, q, k, v, seg, cot)
    with use_mesh(mesh_, rules):
        fn = lambda *a, **kw: causal_attention(*a, query_block=32, window=window, **kw)  # noqa: E731
        got = masked_value_and_grads(fn, q, k, v, seg, cot, SINKS)
    # 1e-5 relative: as unsharded; the shards only change which rows a device computes.
    assert_equal_values_and_grads(got, want, 1e-5)


def test_splash_interpreted_with_a_window_and_sinks_equals_the_dense_path(splash_case):
    (q, k, v, seg, cot), _ = splash_case
    window = 100  # not a multiple of the kernel's 128-row blocks
    splash = lambda *a, **kw: splash_attention(*a, block=128, interpret=True, window=window, **kw)  # noqa: E731
    dense = lambda *a, **kw: dense_attention(*a, window=window, **kw)  # noqa: E731
    got = masked_value_and_grads(splash, q, k, v, seg, cot, SINKS)
    want = masked_value_and_grads(dense, q, k, v, seg, cot, SINKS)
    # 1e-5 relative: float32 online softmax (flash blocks, the sink in its running sum) against
    # the one-pass softmax, values and the gradients of q, k, v and the sinks.
    assert_equal_values_and_grads(got, want, 1e-5)


def test_cudnn_takes_the_window_as_its_local_window_and_refuses_sinks():
    q, k, v, seg, cot = inputs(64, seed=8)
    args = cudnn_arguments(q, k, v, seg, window=6)
    assert args["local_window_size"] == (5, 0)

    def via_jax(q, k, v, seg):
        args = cudnn_arguments(q, k, v, seg, window=6)
        return jax.nn.dot_product_attention(**args, implementation="xla")

    got = value_and_grads(via_jax, q, k, v, seg, cot)
    want = value_and_grads(lambda *a: dense_attention(*a, window=6), q, k, v, seg, cot)
    # 1e-5 relative: the same masked float32 softmax, computed by JAX's reference kernel.
    assert_equal_values_and_grads(got, want, 1e-5)
    with pytest.raises(KilnError, match=r"model\.attention: 'cudnn' has no attention sinks") as e:
        check("cudnn", "gpu", jnp.bfloat16, sinks=True)
    assert "\n" not in str(e.value) and "model.attention_sinks" in str(e.value)


# Gemma 3's shape of model in miniature: sliding layers with their own rotary base between full
# ones (one stack mixing both kinds), and GPT-OSS's sinks.
WINDOWED = dict(
    sliding_window=200,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    local_rope_theta=500.0,
    attention_sinks=True,
    init_std=0.2,
)


def test_mixed_window_layers_with_sinks_match_numpy_unsharded_and_sequence_sharded():
    contexts = ("all_gather", "ring")
    config = assert_transformer_matches_numpy(
        {"num_layers": 3, **WINDOWED}, batch=4, seed=9, contexts=contexts
    )
    assert config.model.local_layers() == (True, False, True)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"sliding_window": 0}, "model.sliding_window"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "model.sliding_window is null"),
        ({"sliding_window": 8, "layer_types": ["full_attention"]}, "no sliding_attention layer"),
        ({"local_rope_theta": 10.0}, "model.local_rope_theta"),
        ({"layer_types": ["full_attention"] * 5}, "at most num_layers"),
        ({"layer_types": []}, "model.layer_types is empty"),
        ({"layer_types": ["local"]}, "model.layer_types.0: got 'local'"),
        ({"family": "deepseek", "sliding_window": 8}, "model.sliding_window is 8 with model.family deepseek"),
        ({"family": "deepseek", "attention_sinks": True}, "model.attention_sinks is True with model.family deepseek"),
    ],
)  # fmt: skip
def test_bad_windows_are_refused_in_one_line(model, message):
    with pytest.raises(KilnError, match=re.escape(message)) as e:
        make_config(model={"num_layers": 4, **model})
    assert "\n" not in str(e.value) and str(e.value).startswith("model.")


def test_kiln_train_refuses_a_window_below_one_before_writing(tmp_path):
    proc = kiln_main(
        "train",
        REPO / "configs" / "tiny.yaml",
        "model.sliding_window=0",
        f"train.output_dir={tmp_path}",
    )
    assert_user_error(proc, "model.sliding_window", "0")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Context load balancing


def test_balanced_order_gives_each_shard_chunks_p_and_2p_minus_1_minus_p():
    assert balanced_order(16, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    order = balanced_order(64, 4)
    assert sorted(order.tolist()) == list(range(64))


@pytest.mark.parametrize(
    ("shards", "window", "sinks", "query_block"),
    [(2, None, False, 32), (4, None, True, 32), (2, 20, True, 32), (2, None, True, 128)],
    ids=["two_shards", "four_shards-sinks", "two_shards-window-sinks", "two_shards-dense_path"],
)
def test_balanced_placement_computes_the_attention_in_order(shards, window, sinks, query_block):
    """Rows placed zigzag (`balanced_order`) and attention told so: the same rows as attention
    in order, values and gradients (the dense path too, for a sequence of one query block)."""
    q, k, v, seg, cot = inputs(128, seed=10)
    sinks = SINKS if sinks else None
    dense = lambda *a, **kw: dense_attention(*a, query_block=32, window=window, **kw)  # noqa: E731
    want = masked_value_and_grads(dense, q, k, v, seg, cot, sinks)
    order = balanced_order(128, shards)
    placed = [jnp.take(x, order, axis=1) for x in (q, k, v, seg, cot)]
    fn = functools.partial(causal_attention, query_block=query_block, shards=shards, window=window)
    with load_balanced():
        loss, grads = masked_value_and_grads(fn, *placed, sinks)
    back = np.argsort(order)
    in_order = [jnp.take(g, back, axis=1) for g in grads[:3]] + list(grads[3:])
    # 1e-5 relative: the same float32 rows, masked by position instead of by row.
    assert_equal_values_and_grads((loss, in_order), want, 1e-5)


def test_balanced_shards_do_equal_work_and_less_of_it():
    """Useful (unmasked) tile products per shard, max over mean: 1.0 balanced against
    (2P-1)T+1 / (PT+1) in order; every shard computes P*T+1 products per step instead of the
    (2P-1)*T+1 the last shard needs in order, and a sequence-sharded step's compiled FLOPs per
    device drop by that ratio (T = 8 local tiles of 4 rows, P = 2)."""
    useful = {}
    for balanced in (False, True):
        _, owner = fold_tables(2, 8, 4, None, balanced)
        per_shard = (owner < 2).sum(axis=(0, 2))
        useful[balanced] = (per_shard.max() / per_shard.mean(), owner.shape[-1])
    assert useful[True] == (1.0, 2 * 8 + 1)
    assert useful[False][0] == pytest.approx((3 * 8 + 1) / (2 * 8 + 1)) and useful[False][1] == 25

    q, k, v, seg, _ = inputs(128, seed=4)
    config = make_config(mesh=dict(fsdp=4, sequence=2))
    mesh, rules = make_mesh(config), config.mesh.rules
    q = jax.device_put(q, logical_sharding(mesh, rules, HEADS))
    kv = logical_sharding(mesh, rules, KV_HEADS)
    k, v = jax.device_put(k, kv), jax.device_put(v, kv)
    seg = jax.device_put(seg, batch_sharding(mesh, rules))

    def flops(balanced):
        def loss(q, k, v):
            return jnp.sum(causal_attention(q, k, v, seg, query_block=32))

        with use_mesh(mesh, rules), load_balanced(balanced):
            grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
            return grad.lower(q, k, v).compile().cost_analysis()["flops"]

    # 5%: the attention's tile products dominate; the rest (index arithmetic, the partitioner's
    # sums) is the same both ways.
    assert flops(True) / flops(False) == pytest.approx((2 * 8 + 1) / (3 * 8 + 1), rel=5e-2)


def test_load_balance_is_refused_where_it_cannot_hold(tmp_path):
    with pytest.raises(
        KilnError, match=r"data\.seq_len: 18 is not divisible by 2 x the 2 seq"
    ) as e:
        make_config(mesh={"fsdp": 4, "sequence": 2}, data={"seq_len": 18})
    assert "\n" not in str(e.value) and "model.context_load_balance: false" in str(e.value)
    make_config(
        mesh={"fsdp": 4, "sequence": 2}, data={"seq_len": 18}, model={"context_load_balance": False}
    )
    deepseek = {
        "family": "deepseek",
        "context_load_balance": True,
        "deepseek": {"mtp_num_layers": 1},
    }
    with pytest.raises(KilnError, match=r"model\.context_load_balance is true with model\.deeps"):
        make_config(model=deepseek)
    # Not asked for, a model with prediction modules keeps its sequences in order.
    deepseek["context_load_balance"] = None
    assert not make_config(model=deepseek).model.balances_context(2)


def test_flops_per_token_count_a_sliding_layers_keys_within_its_window():
    """A query of a sliding layer reads min(i+1, W) keys: W - W^2/2S on average in the S/2
    accounting of the causal layers (MaxText's); the summary says which layers see what."""
    from kiln.model import abstract_model, summary
    from kiln.training.optim import make_optimizer, state_name

    s, w = 256, 64
    types = ["sliding_attention", "full_attention"]
    full = make_config(model={"num_layers": 4}, data={"seq_len": s})
    local = make_config(
        model={"num_layers": 4, "sliding_window": w, "layer_types": types}, data={"seq_len": s}
    )
    n_h = full.model.num_heads * full.model.resolved_head_dim
    saved = abstract_model(full.model).flops_per_token(s) - abstract_model(
        local.model
    ).flops_per_token(s)
    assert saved == 2 * 12 * n_h * (s / 2 - (w - w * w / (2 * s)))
    wide = local.model.model_copy(update={"sliding_window": s})
    assert abstract_model(wide).flops_per_token(s) == abstract_model(full.model).flops_per_token(s)
    text = summary(local, make_optimizer(local.optim).init, state_name(local.optim), 8)
    assert "causal attention over all earlier keys in 2 layers and the last 64 in 2)" in text


# ---------------------------------------------------------------------------------------------
# Ring attention (model.context_parallel: ring)

RING_CASES = {
    "in_order-4_shards": dict(shards=4, s=64),
    "balanced-window-sinks-tiles": dict(shards=2, s=128, window=20, sinks=True, balanced=True, query_block=16),
    "in_order-window-8_shards": dict(shards=8, s=64, window=9),
    "balanced-sinks-narrow_values-4_shards": dict(shards=4, s=64, sinks=True, balanced=True, narrow=True),
}  # fmt: skip


@pytest.mark.parametrize("case", list(RING_CASES))
def test_ring_equals_one_device_values_and_every_gradient(case):
    """Keys and values around a ring of sequence shards, rows in order or placed for load
    balance, packed documents, windows, sinks and values narrower than keys: the output and the
    gradients of queries, keys, values and sinks equal one device's dense attention."""
    c = {"window": None, "sinks": False, "balanced": False, "query_block": 512, "narrow": False}
    c.update(RING_CASES[case])
    q, k, v, seg, cot = inputs(c["s"], seed=11)
    if c["narrow"]:  # latent attention's values (kiln.model.deepseek)
        v, cot = v[..., : H // 2], cot[..., : H // 2]
    sinks = SINKS if c["sinks"] else None
    dense = lambda *a, **kw: dense_attention(*a, query_block=32, window=c["window"], **kw)  # noqa: E731
    want = masked_value_and_grads(dense, q, k, v, seg, cot, sinks)
    config = make_config(mesh=dict(fsdp=8 // c["shards"], sequence=c["shards"]))
    mesh, rules = make_mesh(config), config.mesh.rules
    order = balanced_order(c["s"], c["shards"]) if c["balanced"] else np.arange(c["s"])
    q, k, v, seg, cot = (jnp.take(x, order, axis=1) for x in (q, k, v, seg, cot))
    q, k, v, seg, cot = on_mesh(mesh, rules, q, k, v, seg, cot)
    ring = functools.partial(ring_attention, query_block=c["query_block"], window=c["window"])
    with use_mesh(mesh, rules), load_balanced(c["balanced"]):
        assert sequence_shards() == c["shards"]
        loss, grads = masked_value_and_grads(ring, q, k, v, seg, cot, sinks)
    back = np.argsort(order)
    in_order = [jnp.take(g, back, axis=1) for g in grads[:3]] + list(grads[3:])
    # 1e-5 relative: float32 rows, their softmax merged block by block (online) instead of
    # over all keys at once.
    assert_equal_values_and_grads((loss, in_order), want, 1e-5)


def test_ring_moves_blocks_by_collective_permute_and_gathers_no_keys():
    """The ring's compiled step (values and gradients, 4 sequence shards): every key/value
    block moves by collective-permute, P - 1 hops forward and P backward (with the gradients),
    and no all-gather of keys or values is left."""
    from kiln.commands import hlo as hlo_text

    q, k, v, seg, cot = inputs(64, seed=2)
    config = make_config(mesh=dict(fsdp=2, sequence=4))
    mesh, rules = make_mesh(config), config.mesh.rules
    with use_mesh(mesh, rules):
        loss = lambda q, k, v: jnp.sum(ring_attention(q, k, v, seg) * cot)  # noqa: E731
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
    ops = {kind: c["ops_per_step"] for kind, c in hlo_text.collectives(hlo).items()}
    assert ops.get("collective-permute", 0) > 0
    assert "all-gather" not in ops or not any(
        "16,2,16" in result
        for kind, result, _ in hlo_text.collective_ops(hlo)
        if kind == "all-gather"
    )


def test_a_stack_of_ring_layers_holds_no_mask_of_every_hop():
    """Differentiated under a scan over layers (the model's stack), the ring's masks, which
    depend only on positions and segment ids, are not hoisted out of the loop for every hop
    and tile at once: the scanned stack needs no more temporary memory than the same layers
    unrolled (before: 16x more at 8192 tokens)."""
    s = 2048
    config = make_config(mesh=dict(fsdp=1, sequence=8), data={"seq_len": s})
    mesh, rules = make_mesh(config), config.mesh.rules
    x = jax.device_put(jnp.ones((1, s, 4, 32)), logical_sharding(mesh, rules, HEADS))
    seg = jax.device_put(jnp.ones((1, s), jnp.int32), batch_sharding(mesh, rules))
    w = jnp.full((2, 32, 32), 0.1)

    def layer(x, w):
        q = x @ w
        return x + ring_attention(q, q, q, seg), None

    def scanned(w, x):
        return jax.lax.scan(layer, x, w)[0].sum()

    def unrolled(w, x):
        return layer(layer(x, w[0])[0], w[1])[0].sum()

    with use_mesh(mesh, rules):
        temps = [
            jax.jit(jax.grad(f)).lower(w, x).compile().memory_analysis().temp_size_in_bytes
            for f in (scanned, unrolled)
        ]
    assert temps[0] <= 1.5 * temps[1], temps


def test_balanced_ring_gives_every_shard_the_same_work_per_hop():
    """Counted by the predicate the ring evaluates: placed for load balance every shard
    computes the same products at every hop (max/mean 1.0); in order the last shard computes
    (4P-1)/(2P+1) of the mean, and every hop waits for the busiest shard."""
    shards, s, tiles = 4, 256, 4  # 4 query tiles of 16 rows per shard, 2 per half
    balanced = ring_work(s, shards, balanced=True, query_block=16)
    in_order = ring_work(s, shards, balanced=False, query_block=16)
    assert (balanced == balanced[:1]).all()  # every shard, hop by hop
    assert balanced[0].tolist() == [3 * tiles // 2] + [tiles] * (shards - 1)
    per_shard = in_order.sum(axis=1)
    assert per_shard.max() / per_shard.mean() == pytest.approx((4 * shards - 1) / (2 * shards + 1))
    # The hops' critical path: 2P+1 half-block products balanced against 4P-1 in order.
    critical = [w.max(axis=0).sum() * 2 / tiles for w in (balanced, in_order)]
    assert critical == [2 * shards + 1, 4 * shards - 1]


def test_ring_is_refused_without_sequence_shards_or_with_a_fused_kernel(tmp_path):
    ring = {"model": {"context_parallel": "ring"}}
    with pytest.raises(KilnError, match=r"model\.context_parallel: 'ring' passes keys") as e:
        make_config(**ring, mesh={"fsdp": 8})
    assert "\n" not in str(e.value)
    tiny, out = REPO / "configs" / "tiny.yaml", f"train.output_dir={tmp_path}"
    proc = kiln_main("train", tiny, "model.context_parallel=ring", out)
    assert_user_error(proc, "model.context_parallel: 'ring' passes keys", "mesh.sequence > 1")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(KilnError, match=r"model\.context_parallel: 'ring' runs kiln's own"):
        make_config(model={"context_parallel": "ring", "attention": "splash"})
    with pytest.raises(KilnError, match=r"model\.context_parallel: got 'rings'"):
        make_config(model={"context_parallel": "rings"})
