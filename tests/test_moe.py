"""The moe family: the layer against a float64 per-token reference, its balance terms against
their formulas, expert parallelism against one device, and the seam that carries a family's
aux terms to the loss and the metrics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import equations, make_config
from kiln.config import FAMILY_SECTIONS, MESH_AXES
from kiln.model import FAMILIES, Family, ModelOutput
from kiln.model.llama import Transformer
from kiln.model.moe import (
    ExpertWeights,
    MoeMlp,
    blocked_rows,
    expert_layout,
    ragged_rows,
    sort_by_expert,
    swiglu,
)
from kiln.model.moe.experts import blocked_assignments
from kiln.parallel.exchange import take_copies, take_rows
from kiln.parallel.mesh import make_mesh, use_mesh
from kiln.training import train
from kiln.training.objective import lm_loss_sums

D, F, B, S = 32, 16, 8, 16


def rel_err(a, b) -> float:
    """max |a - b| / max |b|: a relative error that near-zero entries cannot blow up."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def moe_config(mesh=None, layers=2, **moe):
    model = {"family": "moe", "d_model": D, "num_heads": 2, "num_layers": layers, "d_ff": 48}
    model["vocab_size"], model["max_seq_len"] = 128, S
    moe = {"num_experts": 8, "experts_per_token": 2, "d_ff_expert": F, **moe}
    return make_config(
        model={**model, "moe": moe},
        data={"seq_len": S},
        mesh=mesh or {"fsdp": -1},
        train={"global_batch_size": 8},
    )


# ---------------------------------------------------------------------------------------------
# float64 reference: every token through its top-k experts, weighted, and its backward pass


def _silu(x):
    return x / (1 + np.exp(-x))


def choose(scores, bias, moe):
    """A token's experts, as DeepSeek-V3's router picks them (softmax routers too): the top-k
    of scores + bias within the topk_group groups whose two best biased scores sum highest."""
    choice = scores + bias
    if moe.n_group > 1:
        groups = choice.reshape(moe.n_group, -1)
        worth = np.sort(groups, axis=-1)[:, -2:].sum(-1)
        kept = np.argsort(-worth, kind="stable")[: moe.topk_group]
        mask = np.zeros(moe.n_group, bool)
        mask[kept] = True
        choice = np.where(np.repeat(mask, groups.shape[1]), choice, -np.inf)
    return np.argsort(-choice, kind="stable")[: moe.experts_per_token]


def reference(p, x, moe, g, keep=None):
    """(y, dL/dx, dL/dparams) in float64 for L = sum(g * y), token by token; `p["bias"]`: the
    aux_free bias (not differentiated); `keep` [T, K]: False for a token's j-th choice that was
    dropped (its output 0; its weight still counts in the top-k's normalisation)."""
    x, g = np.asarray(x, np.float64).reshape(-1, D), np.asarray(g, np.float64).reshape(-1, D)
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    bias = p.pop("bias", np.zeros(moe.num_experts))
    grads = {k: np.zeros_like(v) for k, v in p.items()}
    y, dx = np.zeros_like(x), np.zeros_like(x)
    scale = moe.routed_scaling_factor
    for t in range(x.shape[0]):
        logits = x[t] @ p["router"]
        if moe.score == "sigmoid":
            probs = 1 / (1 + np.exp(-logits))
        else:
            probs = np.exp(logits - logits.max())
            probs /= probs.sum()
        top = choose(probs, bias, moe)
        total = probs[top].sum() if moe.norm_topk_prob else 1.0
        dw = np.zeros(len(top))
        for j, e in enumerate(top):
            if keep is not None and not keep[t, j]:
                continue
            gate, up = x[t] @ p["w_gate"][e], x[t] @ p["w_up"][e]
            h = _silu(gate) * up
            out = h @ p["w_down"][e]
            w = scale * probs[e] / total
            y[t] += w * out
            dw[j] = g[t] @ out
            # Through the expert, scaled by its weight.
            dout = w * g[t]
            grads["w_down"][e] += np.outer(h, dout)
            dh = p["w_down"][e] @ dout
            sig = 1 / (1 + np.exp(-gate))
            dgate = dh * up * (sig + gate * sig * (1 - sig))
            dup = dh * _silu(gate)
            grads["w_gate"][e] += np.outer(x[t], dgate)
            grads["w_up"][e] += np.outer(x[t], dup)
            dx[t] += p["w_gate"][e] @ dgate + p["w_up"][e] @ dup
        if "shared_gate" in p:
            gate, up = x[t] @ p["shared_gate"], x[t] @ p["shared_up"]
            h = _silu(gate) * up
            y[t] += h @ p["shared_down"]
            grads["shared_down"] += np.outer(h, g[t])
            dh = p["shared_down"] @ g[t]
            sig = 1 / (1 + np.exp(-gate))
            dgate, dup = dh * up * (sig + gate * sig * (1 - sig)), dh * _silu(gate)
            grads["shared_gate"] += np.outer(x[t], dgate)
            grads["shared_up"] += np.outer(x[t], dup)
            dx[t] += p["shared_gate"] @ dgate + p["shared_up"] @ dup
        # Through the weights: w_j = scale * p_j / total (renormalised) or scale * p_j, with
        # p = softmax(logits) or sigmoid(logits).
        dp = np.zeros_like(probs)
        if moe.norm_topk_prob:
            dp[top] = scale * (dw - np.sum(dw * probs[top]) / total) / total
        else:
            dp[top] = scale * dw
        if moe.score == "sigmoid":
            dlogits = dp * probs * (1 - probs)
        else:
            dlogits = probs * (dp - np.sum(dp * probs))
        grads["router"] += np.outer(x[t], dlogits)
        dx[t] += p["router"] @ dlogits
    return y, dx, grads


def layer_params(layer: MoeMlp) -> dict[str, np.ndarray]:
    p = {k: getattr(layer, k)[...] for k in ("router", "w_gate", "w_up", "w_down")}
    if layer.shared is not None:
        s = layer.shared
        p |= {"shared_gate": s.w_gate[...], "shared_up": s.w_up[...], "shared_down": s.w_down[...]}
    return p


def kiln_grads(grads_state) -> dict[str, np.ndarray]:
    flat = {"/".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(grads_state)}
    out = {k: flat[k] for k in ("router", "w_gate", "w_up", "w_down")}
    if "shared/w_gate" in flat:
        out |= {f"shared_{k[2:]}": flat[f"shared/{k}"] for k in ("w_gate", "w_up", "w_down")}
    return out


def run_layer(layer, x, g, segment_ids, mesh=None, rules=None):
    """(y, dL/dx, dL/dparams) of the kiln layer for L = sum(g * y), on `mesh` or unsharded."""
    graphdef, state = nnx.split(layer)

    def loss(state, x):
        y, _ = nnx.merge(graphdef, state)(x, segment_ids)
        return jnp.sum(y * g), y

    with use_mesh(mesh, rules):
        (_, y), (d_state, dx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
            state, x
        )
    return y, dx, kiln_grads(d_state)


SETTINGS = {
    "E8 k2": {},
    # Switch: one expert weighted by its probability (renormalised, every weight would be 1).
    "E4 k1": {"num_experts": 4, "experts_per_token": 1, "norm_topk_prob": False},
    "E8 k2 shared 1": {"num_shared_experts": 1},
    "E8 k3 raw probs": {"experts_per_token": 3, "norm_topk_prob": False},
    "E8 k2 ragged_dot": {"grouped_matmul": "ragged_dot"},
    # DeepSeek-V3's router: sigmoid scores, 2 of 4 groups, scaled weights, a routing bias.
    "E8 k2 sigmoid groups": {
        "score": "sigmoid",
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "balance": "aux_free",
        "num_shared_experts": 1,
    },
    "E8 k3 sigmoid raw": {"score": "sigmoid", "experts_per_token": 3, "norm_topk_prob": False},
}


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, S, D)).astype(np.float32)
    g = rng.standard_normal((B, S, D)).astype(np.float32)
    return x, g, np.ones((B, S), np.int32)


@pytest.mark.parametrize("setting", SETTINGS)
def test_layer_and_its_gradients_equal_the_float64_per_token_reference(inputs, setting):
    x, g, segments = inputs
    cfg = moe_config(**SETTINGS[setting]).model
    layer = MoeMlp(cfg, rngs=nnx.Rngs(1))
    params = layer_params(layer)
    if layer.bias is not None:  # a bias that changes the choices (scores lie in 0..1)
        layer.bias[...] = jnp.asarray(np.random.default_rng(2).uniform(-0.3, 0.3, 8), jnp.float32)
        params["bias"] = layer.bias[...]
    want_y, want_dx, want_grads = reference(params, x, cfg.moe, g)
    y, dx, grads = run_layer(layer, x, g, segments)
    assert rel_err(y.reshape(-1, D), want_y) <= 1e-5  # tolerance: 1e-5 relative (float32)
    assert rel_err(dx.reshape(-1, D), want_dx) <= 1e-5  # tolerance: 1e-5 relative (float32)
    for name, want in want_grads.items():
        assert rel_err(grads[name], want) <= 1e-5, name  # tolerance: 1e-5 relative (float32)


def test_groups_and_the_bias_change_which_experts_a_token_takes(inputs):
    """kiln's choices are the reference's, token by token, and the groups and the bias are not
    idle: each changes some token's experts."""
    from kiln.model.moe import route

    x, _, _ = inputs
    cfg = moe_config(**SETTINGS["E8 k2 sigmoid groups"]).model
    moe = cfg.moe
    router = np.random.default_rng(3).standard_normal((D, 8)).astype(np.float32) / np.sqrt(D)
    bias = np.random.default_rng(2).uniform(-0.3, 0.3, 8).astype(np.float32)
    experts, *_ = route(jnp.asarray(x), jnp.asarray(router), jnp.asarray(bias), moe)
    logits = x.reshape(-1, D).astype(np.float64) @ router.astype(np.float64)
    scores = 1 / (1 + np.exp(-logits))
    plain = moe.model_copy(update={"n_group": 1, "topk_group": 1})
    want = [set(choose(s, bias, moe)) for s in scores]
    assert [set(e) for e in np.asarray(experts).reshape(-1, 2).tolist()] == want
    assert want != [set(choose(s, bias, plain)) for s in scores]  # the groups choose
    assert want != [set(choose(s, 0 * bias, moe)) for s in scores]  # the bias chooses


@pytest.mark.parametrize("setting", ["E8 k2", "E8 k2 shared 1", "E8 k2 ragged_dot"])
def test_expert_parallel_layer_equals_one_device(inputs, setting):
    """Experts split 4 ways (all-to-all inside shard_map) and fsdp 2: the same outputs and
    gradients as the unsharded layer."""
    assert_sharded_layer_equals_one_device(
        moe_config(mesh={"expert": 4, "fsdp": 2}, **SETTINGS[setting]), inputs
    )


def assert_sharded_layer_equals_one_device(config, inputs):
    """The layer on `config`'s mesh gives the unsharded layer's outputs and gradients;
    (the layer, the mesh)."""
    x, g, segments = inputs
    layer = MoeMlp(config.model, rngs=nnx.Rngs(1))
    want = run_layer(layer, x, g, segments)
    mesh = make_mesh(config)
    got = run_layer(layer, x, g, segments, mesh, config.mesh.rules)
    assert rel_err(got[0], want[0]) <= 1e-5  # tolerance: 1e-5 relative (float32)
    assert rel_err(got[1], want[1]) <= 1e-5  # tolerance: 1e-5 relative (float32)
    for name in want[2]:
        assert rel_err(got[2][name], want[2][name]) <= 1e-5, name  # 1e-5 relative (float32)
    return layer, mesh


def test_expert_parallelism_moves_tokens_by_all_to_all(inputs):
    x, _, segments = inputs
    config = moe_config(mesh={"expert": 4, "fsdp": 2})
    graphdef, state = nnx.split(MoeMlp(config.model, rngs=nnx.Rngs(1)))
    with use_mesh(make_mesh(config), config.mesh.rules):
        hlo = (
            jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, segments)[0])
            .lower(state, x)
            .compile()
            .as_text()
        )
    # Tokens there and outputs back: on CPU each ragged exchange is a dense all-to-all of
    # padded chunks and a small one of where they land.
    assert hlo.count("all-to-all(") >= 4


def choices(layer, x, moe) -> np.ndarray:
    """[B, S, K] each token's experts, chosen in float64 (the reference's router)."""
    logits = np.asarray(x, np.float64) @ np.asarray(layer.router[...], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    zero = np.zeros(moe.num_experts)
    return np.array([[choose(p, zero, moe) for p in row] for row in probs])


def expert_parallel_keep(top, real, moe, shards) -> np.ndarray:
    """[B, S, K]: which assignments expert parallelism over `shards` devices keeps, one
    sequence per device (`moe_config`'s 8 sequences on 8 devices, fsdp groups of `shards`).

    A source keeps each expert's first C = ceil(c T K / E) assignments (first choices first,
    then token order) and sends them grouped by expert; a receiver takes its sources' chunks
    in source order, each whole until its buffer of buffer_factor * T * K rows (rounded up to
    8; dropless: room for all) is full, then the start of the next.
    """
    b, t, k = top.shape
    e, local = moe.num_experts, moe.num_experts // shards
    cap = None if moe.capacity_factor is None else int(np.ceil(moe.capacity_factor * t * k / e))
    room = shards * min(t * k, t * local, cap * local if cap else t * k)
    if moe.buffer_factor is not None:
        room = min(room, -(-int(np.ceil(moe.buffer_factor * t * k)) // 8) * 8)
    keep = np.zeros(top.shape, bool)
    for group in range(b // shards):
        chunks = {}
        for src in range(shards):
            seq = group * shards + src
            taken, kept = np.zeros(e, int), []
            for j in range(k):
                for tok in np.flatnonzero(real[seq]):
                    ex = top[seq, tok, j]
                    if cap is None or taken[ex] < cap:
                        taken[ex] += 1
                        kept.append((ex, j, tok))
            kept.sort(key=lambda r: r[0])  # stable: by expert, then in the order above
            for dest in range(shards):
                chunks[src, dest] = [(j, tok) for ex, j, tok in kept if ex // local == dest]
        for dest in range(shards):
            free = room
            for src in range(shards):
                for j, tok in chunks[src, dest][: max(free, 0)]:
                    keep[group * shards + src, tok, j] = True
                free -= len(chunks[src, dest])
    return keep


@pytest.mark.parametrize(
    "setting",
    [
        {"buffer_factor": 0.75},
        {"capacity_factor": 0.5},
        {"capacity_factor": 1.0, "buffer_factor": 0.5},
    ],
    ids=["buffer 0.75", "capacity 0.5", "capacity 1 buffer 0.5"],
)
def test_expert_parallel_drops_exactly_what_the_capacity_and_the_buffer_leave_out(inputs, setting):
    """Experts split 4 ways with a capacity, a bounded receive buffer or both: the outputs and
    gradients are the float64 reference's over the assignments kept, and moe/dropped_tokens
    counts the others exactly (padding is never routed nor counted)."""
    x, g, segments = inputs
    segments = segments.copy()
    segments[:, -3:] = 0
    config = moe_config(mesh={"expert": 4, "fsdp": 2}, **setting)
    moe = config.model.moe
    layer = MoeMlp(config.model, rngs=nnx.Rngs(1))
    real = segments > 0
    keep = expert_parallel_keep(choices(layer, x, moe), real, moe, 4)
    keep &= real[..., None]
    want_y, want_dx, want_grads = reference(layer_params(layer), x, moe, g, keep.reshape(B * S, -1))
    mesh = make_mesh(config)
    y, dx, grads = run_layer(layer, x, g, segments, mesh, config.mesh.rules)
    graphdef, state = nnx.split(layer)
    with use_mesh(mesh, config.mesh.rules):
        aux = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, segments)[1])(state, x)
    assert float(aux["moe/dropped_tokens"]) == (real[..., None] & ~keep).sum() > 0
    assert rel_err(y.reshape(-1, D), want_y) <= 1e-5  # tolerance: 1e-5 relative (float32)
    assert rel_err(dx.reshape(-1, D), want_dx) <= 1e-5  # tolerance: 1e-5 relative (float32)
    for name, want in want_grads.items():
        assert rel_err(grads[name], want) <= 1e-5, name  # tolerance: 1e-5 relative (float32)


def test_expert_tensor_parallel_layer_equals_one_device(inputs):
    """Experts split 2 ways and their d_ff 2 ways over tensor (fsdp 2): the same outputs and
    gradients as the unsharded layer, and no device gathers an expert whole: the expert
    weights enter the expert computation as [E/2, D, F/2] slices."""
    x, _, segments = inputs
    config = moe_config(mesh={"expert": 2, "tensor": 2, "fsdp": 2})
    layer, mesh = assert_sharded_layer_equals_one_device(config, inputs)
    graphdef, state = nnx.split(layer)
    with use_mesh(mesh, config.mesh.rules):
        jaxpr = str(jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(x, segments)[0])(state))
    assert f"f32[4,{D},{F // 2}]" in jaxpr and f"f32[4,{D},{F}]" not in jaxpr


def test_grouped_matmuls_agree_on_uneven_and_empty_groups():
    """Rows grouped by expert, experts with no rows, one expert with most of them, unused rows
    past the groups: both grouped matmuls give each grouped row its expert's output (blocked:
    0 past the groups, which ragged_dot leaves unspecified and kiln never reads)."""
    rng = np.random.default_rng(3)
    rows, e = 200, 6
    x = rng.standard_normal((rows, D)).astype(np.float32)
    experts = np.where(rng.uniform(size=rows) < 0.7, 2, rng.integers(0, e, rows)).astype(np.int32)
    experts[experts == 4] = 5  # expert 4 gets no rows
    used = 180  # the last 20 rows belong to no group
    sizes = np.bincount(np.sort(experts[:used]), minlength=e).astype(np.int32)
    grouped = np.sort(experts[:used], kind="stable")
    w = [rng.standard_normal(s).astype(np.float32) * 0.2 for s in [(e, D, F), (e, D, F), (e, F, D)]]
    want = np.zeros((rows, D))
    for r in range(used):
        k = grouped[r]
        x64 = x[r].astype(np.float64)
        h = _silu(x64 @ w[0][k]) * (x64 @ w[1][k])
        want[r] = h @ w[2][k]
    args = (jnp.asarray(x), jnp.asarray(sizes), *map(jnp.asarray, w))
    got = ragged_rows(*args)
    assert rel_err(got[:used], want[:used]) <= 1e-5  # tolerance: 1e-5 relative (float32)
    for block in (None, 8, 16, 64):  # any block size is exact
        got = blocked_rows(*args, block)
        assert rel_err(got, want) <= 1e-5, block  # tolerance: 1e-5 relative (float32)


def test_gather_permutes_equal_the_scatter_ones_bitwise_values_and_gradients():
    """The layer's permutations (assignments grouped by expert and back, `expert_layout`) by
    `take_rows`, whose backward pass is the gather of the inverse permutation, against the same
    permutations written as scatters (autodiff's transpose of a gather is a scatter-add):
    equal bitwise, forward and backward, with padding and a capacity dropping rows."""
    rng = np.random.default_rng(4)
    t, k, e = 64, 2, 8
    e_A = rng.integers(0, e, t * k).astype(np.int32)
    e_A[rng.uniform(size=t * k) < 0.1] = e  # padding: no expert
    src, slot, kept, _ = expert_layout(jnp.asarray(e_A), e, cap=10)
    x = jnp.asarray(rng.standard_normal((t * k, D)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((t * k, D)), jnp.float32)

    def by_gather(x):
        return take_rows(take_rows(x, src, slot) * 2.0, slot, src)

    def by_scatter(x):
        grouped = jnp.zeros_like(x).at[slot].set(x, mode="drop")
        return (grouped * 2.0).at[slot].get(mode="fill", fill_value=0)

    assert int(jnp.sum(kept)) < int(np.sum(e_A < e))  # the capacity drops some rows
    want, want_dx = jax.value_and_grad(lambda x: jnp.sum(by_scatter(x) * g))(x)
    got, got_dx = jax.value_and_grad(lambda x: jnp.sum(by_gather(x) * g))(x)
    assert np.array_equal(by_gather(x), by_scatter(x))  # bitwise
    assert np.array_equal(got, want) and np.array_equal(got_dx, want_dx)  # bitwise


def test_tokens_straight_into_blocks_equal_the_grouped_layout_then_blocks_bitwise():
    """On one device the blocked matmul's tokens go straight from the sort into their blocks
    and back (`blocked_assignments`, outputs in token order): the same outputs and gradients,
    bitwise, as gathering the grouped layout and then the blocks (`blocked_rows`), with
    padding and a capacity dropping assignments."""
    rng = np.random.default_rng(5)
    t, k, e = 64, 2, 8
    e_A = rng.integers(0, e, t * k).astype(np.int32)
    e_A[rng.uniform(size=t * k) < 0.1] = e  # padding: no expert
    src, slot, kept, _ = expert_layout(jnp.asarray(e_A), e, cap=10)
    sort = sort_by_expert(jnp.asarray(e_A), e, cap=10)
    x = jnp.asarray(rng.standard_normal((t, D)), jnp.float32)
    g_KTD = jnp.asarray(rng.standard_normal((k, t, D)), jnp.float32)
    w = ExpertWeights(
        *(
            jnp.asarray(rng.standard_normal(s) * 0.2, jnp.float32)
            for s in [(e, D, F), (e, D, F), (e, F, D)]
        )
    )

    def composed(x, w):  # [T, K, D]
        return blocked_assignments(x, jnp.asarray(e_A), sort, w, swiglu)

    def two_steps(x, w):  # [K, T, D]
        a = t * k
        x_CD = take_copies(x, jnp.where(src < a, src % t, t), slot.reshape(k, t))
        return take_rows(blocked_rows(x_CD, kept, *w[:3]), slot, src).reshape(k, t, D)

    assert int(jnp.sum(kept)) < int(np.sum(e_A < e))  # the capacity drops some assignments
    got, got_vjp = jax.vjp(composed, x, w)
    want, want_vjp = jax.vjp(two_steps, x, w)
    assert np.array_equal(got.transpose(1, 0, 2), want)  # bitwise
    got_grads, want_grads = got_vjp(g_KTD.transpose(1, 0, 2)), want_vjp(g_KTD)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        assert np.array_equal(a, b)  # bitwise


def test_a_layer_sorts_once_and_moves_rows_only_by_gathers():
    """The gradient of the layer (ragged_dot, the TPU path) has one sort and no scatter of
    rows: its scatters are the sort's integer inverse and the router's [B, S, E] weights."""
    cfg = moe_config(grouped_matmul="ragged_dot").model
    layer = MoeMlp(cfg, rngs=nnx.Rngs(1))
    graphdef, state = nnx.split(layer)
    x = jnp.ones((B, S, D), jnp.float32)

    def loss(state, x):
        return jnp.sum(nnx.merge(graphdef, state)(x, jnp.ones((B, S), jnp.int32))[0])

    eqns = equations(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(state, x).jaxpr)
    sorts = [q for q in eqns if q.primitive.name == "sort"]
    scatters = [q.outvars[0].aval for q in eqns if q.primitive.name.startswith("scatter")]
    assert len(sorts) == 1
    assert all(a.dtype == jnp.int32 or a.shape[-1] == cfg.moe.num_experts for a in scatters)
    assert scatters  # the walk reached the layer's body


# ---------------------------------------------------------------------------------------------
# The balance and stability terms


def test_router_z_loss_and_load_balance_equal_their_float64_formulas(inputs):
    x, _, _ = inputs
    segments = np.ones((B, S), np.int32)
    segments[:, -5:] = 0  # padding: routed, but never counted
    cfg = moe_config(router_z_loss=1e-3, load_balance_loss=1e-2).model
    layer = MoeMlp(cfg, rngs=nnx.Rngs(1))
    _, aux = layer(jnp.asarray(x), jnp.asarray(segments))
    x64 = x.astype(np.float64).reshape(-1, D)
    real = segments.reshape(-1) > 0
    logits = x64 @ np.asarray(layer.router[...], np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    probs = np.exp(logits - lse[:, None])
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :2]
    chosen = np.zeros_like(probs)
    np.put_along_axis(chosen, top, 1.0, axis=-1)
    n, e, k = real.sum(), 8, 2
    f = chosen[real].sum(0) / (k * n)  # fraction of the assignments each expert got
    p_mean = probs[real].mean(0)  # mean router probability of each expert
    # ST-MoE's router z-loss and Switch's balance loss, as sums over the real tokens.
    z_want = 1e-3 * np.sum(lse[real] ** 2)
    lb_want = 1e-2 * e * np.sum(f * p_mean) * n
    assert rel_err(aux["learning/router_z_loss"], z_want) <= 1e-5  # 1e-5 relative (float32)
    assert rel_err(aux["learning/moe_lb_loss"], lb_want) <= 1e-5  # 1e-5 relative (float32)
    assert np.array_equal(aux["moe/expert_tokens"], chosen[real].sum(0))  # exact counts


def test_zero_weights_give_the_step_that_never_computes_them(monkeypatch):
    """router_z_loss: 0 and load_balance_loss: 0 add nothing: the step is bitwise the one of a
    layer that computes no aux at all (the losses of 2 steps, and the parameters after them)."""
    config = one_device(moe_config(layers=1))
    batch = lm_batch(config)
    mesh = make_mesh(config, jax.devices()[:1])

    def two_steps():
        state = train.init_state(config, mesh)
        step = train.make_train_step(config, mesh, train.shardings_of(state))
        losses = []
        for _ in range(2):
            state, metrics = step(state, batch)
            losses.append(float(metrics["learning/loss"]))
        return losses, [np.asarray(p) for p in jax.tree.leaves(state.params)]

    want = two_steps()
    monkeypatch.setattr(MoeMlp, "_aux", lambda self, *args: {})
    got = two_steps()
    assert got[0] == want[0]  # bitwise: the losses of both steps
    assert all(np.array_equal(a, b) for a, b in zip(got[1], want[1], strict=True))  # bitwise


def test_capacity_drops_the_assignments_past_each_experts_capacity(inputs):
    """capacity_factor 0.5: each expert keeps its first C = ceil(0.5 * T * K / E) assignments
    of real tokens, first choices before second ones, then in token order; moe/dropped_tokens
    counts the rest, and the output is the sum over the kept assignments (0 for padding)."""
    x, _, segments = inputs
    segments = segments.copy()
    segments[:, -3:] = 0  # padding: not routed, takes no capacity, never counted as dropped
    cfg = moe_config(capacity_factor=0.5).model
    layer = MoeMlp(cfg, rngs=nnx.Rngs(1))
    y, aux = layer(jnp.asarray(x), jnp.asarray(segments))
    real = segments.reshape(-1) > 0
    t, k, e = B * S, 2, 8
    cap = int(np.ceil(0.5 * t * k / e))
    x64 = x.astype(np.float64).reshape(-1, D)
    p = {kk: np.asarray(v, np.float64) for kk, v in layer_params(layer).items()}
    logits = x64 @ p["router"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    taken = np.zeros(e, int)
    keep = np.zeros((t, k), bool)
    for j in range(k):
        for tok in np.flatnonzero(real):
            if taken[top[tok, j]] < cap:
                taken[top[tok, j]] += 1
                keep[tok, j] = True
    want = np.zeros_like(x64)
    for tok in range(t):
        w = probs[tok, top[tok]] / probs[tok, top[tok]].sum()
        for j in np.flatnonzero(keep[tok]):
            ex = top[tok, j]
            h = _silu(x64[tok] @ p["w_gate"][ex]) * (x64[tok] @ p["w_up"][ex])
            want[tok] += w[j] * (h @ p["w_down"][ex])
    assert float(aux["moe/dropped_tokens"]) == (~keep[real]).sum() > 0
    assert rel_err(y.reshape(-1, D), want) <= 1e-5  # tolerance: 1e-5 relative (float32)


@pytest.mark.parametrize("name", ["adamw", "muon", "adafactor", "lion"])
def test_each_optimizer_moves_the_router_and_experts_but_never_the_aux_free_bias(name):
    """One step of each optimizer: the routing bias moves towards equal load outside the
    gradient, exactly where the balance rule puts it (the optimizer adds nothing, weight decay
    included; centred, so the biases never drift together), the router and every expert move,
    and the step logs the load's max over mean, not the loads."""
    config = one_device(moe_config(layers=1, balance="aux_free", bias_update_rate=0.01))
    config = config.model_copy(
        update={"optim": config.optim.model_copy(update={"name": name, "weight_decay": 0.1})}
    )
    batch = lm_batch(config)
    mesh = make_mesh(config, jax.devices()[:1])
    state = train.init_state(config, mesh)
    mlp = state.params["blocks"]["mlp"]
    before = {k: np.asarray(mlp[k].get_value()) for k in ("bias", "router", "w_gate", "w_down")}
    out = state.model().hidden_states(batch["inputs"], batch["positions"], batch["segment_ids"])
    loads = np.asarray(out.aux["moe/expert_tokens"])
    step = train.make_train_step(config, mesh, train.shardings_of(state))
    state, metrics = step(state, batch)
    mlp = state.params["blocks"]["mlp"]
    move = np.sign(loads.mean(-1, keepdims=True) - loads)
    want = before["bias"] + np.float32(0.01) * (move - move.mean(-1, keepdims=True))
    bias = np.asarray(mlp["bias"].get_value())
    assert np.abs(bias - want).max() <= 1e-9  # float32 rounding
    assert np.abs(bias.sum(-1) - before["bias"].sum(-1)).max() <= 1e-8
    ratio = loads.max(-1) / loads.mean(-1)
    assert float(metrics["moe/expert_load_max_over_mean"]) == pytest.approx(ratio.max(), rel=1e-6)
    assert "moe/expert_tokens" not in metrics  # arrays feed update_balance, not the logs
    for key in ("router", "w_gate", "w_down"):
        moved = np.abs(np.asarray(mlp[key].get_value()) - before[key])
        assert np.isfinite(moved).all() and (moved > 0).all(), key


# ---------------------------------------------------------------------------------------------
# Training steps: expert parallelism and gradient accumulation against one device


def lm_batch(config, seed=0):
    rng = np.random.default_rng(seed)
    shape = (config.train.global_batch_size, S)
    tokens = rng.integers(1, 128, shape).astype(np.int32)
    segments = np.ones(shape, np.int32)
    segments[:, -3:] = 0  # a little padding
    return {
        "inputs": tokens,
        "targets": np.roll(tokens, -1, axis=1),
        "positions": np.broadcast_to(np.arange(S, dtype=np.int32), shape).copy(),
        "segment_ids": segments,
        "weights": (segments > 0).astype(np.float32),
    }


def run_steps(config, batch, steps=3):
    """(losses of `steps` train steps, or with none the batch's loss; gradients of the first
    step) on `config`'s mesh."""
    sizes = [getattr(config.mesh, a) for a in MESH_AXES]
    mesh = make_mesh(config, jax.devices()[: 8 if -1 in sizes else int(np.prod(sizes))])
    state = train.init_state(config, mesh)
    loss, _, grads = train.loss_and_grads(config, state, batch)
    grads = [np.asarray(g) for g in jax.tree.leaves(grads)]
    if not steps:
        return [float(loss)], grads
    step = train.make_train_step(config, mesh, train.shardings_of(state))
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["learning/loss"]))
    return losses, grads


def one_device(config):
    sizes = dict.fromkeys(MESH_AXES, 1)
    return config.model_copy(update={"mesh": config.mesh.model_copy(update=sizes)})


def test_expert_parallel_training_equals_one_device():
    """mesh.expert=4 mesh.fsdp=2 (8 devices) with the router losses on equal one device within
    1e-5 relative: the loss and gradients of a global batch in one micro-batch and in 2, and
    the losses of 3 train steps with 2 (the update after the gradients is the same with any
    accumulation). Parameters after AdamW are not compared: its division by sqrt(v) magnifies
    the rounding of near-zero gradients."""
    config = moe_config(
        mesh={"expert": 4, "fsdp": 2},
        first_dense_layers=1,
        router_z_loss=1e-3,
        load_balance_loss=1e-2,
        balance="aux_free",
    )
    batch = lm_batch(accumulated(config, 2))
    for accumulation, steps in ((1, 0), (2, 3)):
        cfg = accumulated(config, accumulation)
        rows = {k: v[: 8 * accumulation] for k, v in batch.items()}
        want_losses, want = run_steps(one_device(cfg), rows, steps)
        got_losses, got = run_steps(cfg, rows, steps)
        assert rel_err(got_losses, want_losses) <= 1e-5, accumulation  # 1e-5 relative (float32)
        for a, b in zip(got, want, strict=True):
            # tolerance: 1e-5 relative (float32); the aux_free biases' gradients are exactly 0.
            assert np.array_equal(a, b) or rel_err(a, b) <= 1e-5, accumulation


def accumulated(config, accumulation):
    """`config` with `accumulation` micro-batches of its global batch size each."""
    train_cfg = config.train.model_copy(
        update={"gradient_accumulation_steps": accumulation, "global_batch_size": 8 * accumulation}
    )
    return config.model_copy(update={"train": train_cfg})


# ---------------------------------------------------------------------------------------------
# The seam: a family's aux term reaches the loss and the metrics without edits to the trainer


class ToyFamily(Transformer):
    """llama with one extra loss term: 0.5 * the mean squared final hidden state per token."""

    def hidden_states(self, inputs_BS, positions_BS, segment_ids_BS, *, collect=()):
        out = super().hidden_states(inputs_BS, positions_BS, segment_ids_BS, collect=collect)
        real_BS = (segment_ids_BS > 0).astype(jnp.float32)
        per_token = jnp.mean(out.hidden.astype(jnp.float32) ** 2, axis=-1)
        aux = {"learning/toy_loss": 0.5 * jnp.sum(per_token * real_BS)}
        return ModelOutput(out.hidden, out.features, {**out.aux, **aux})


@pytest.fixture
def toy_family(monkeypatch):
    monkeypatch.setitem(FAMILY_SECTIONS, "toy", ())
    monkeypatch.setitem(FAMILIES, "toy", Family(ToyFamily, FAMILIES["llama"].hf))


def test_a_toy_familys_aux_term_reaches_the_loss_and_the_metrics(toy_family):
    llama = make_config(
        model={"d_model": D, "num_heads": 2, "num_layers": 1, "d_ff": 48, "vocab_size": 128},
        data={"seq_len": S},
        mesh={"fsdp": 1},
        train={"global_batch_size": 8},
    )
    toy = llama.model_copy(update={"model": llama.model.model_copy(update={"family": "toy"})})
    batch = lm_batch(llama)
    mesh = make_mesh(toy, jax.devices()[:1])
    state = train.init_state(toy, mesh)
    loss, aux, grads = train.loss_and_grads(toy, state, batch)
    # The same parameters in the plain llama model: the loss without the term.
    plain = nnx.eval_shape(lambda: Transformer(llama.model, rngs=nnx.Rngs(0)))
    lm_state = state.replace(graphdef=nnx.split(plain, nnx.Param, ...)[0])
    lm_loss, _, lm_grads = train.loss_and_grads(llama, lm_state, batch)
    model = state.model()
    out = model.hidden_states(batch["inputs"], batch["positions"], batch["segment_ids"])
    hidden = np.asarray(out.hidden, np.float64)
    real = batch["segment_ids"] > 0
    toy_want = 0.5 * np.sum(np.mean(hidden**2, -1) * real) / real.sum()  # per token it ran
    assert rel_err(aux["learning/toy_loss"], toy_want) <= 1e-5  # 1e-5 relative (float32)
    assert rel_err(loss, float(lm_loss) + toy_want) <= 1e-5  # 1e-5 relative (float32)
    # The term has gradients: the final norm's scale moves differently.
    diff = [
        float(jnp.abs(a - b).max())
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(lm_grads))
    ]
    assert max(diff) > 1e-4
    step = train.make_train_step(toy, mesh, train.shardings_of(state))
    _, metrics = step(state, batch)
    assert rel_err(metrics["learning/toy_loss"], toy_want) <= 1e-5  # 1e-5 relative (float32)


def test_router_losses_are_per_routed_token_whatever_the_loss_weights():
    """Chat-like weights (a prompt of weight 0, in the rows of one micro-batch only) leave the
    router losses per token the router saw: their value, and their share of the gradient, are
    those of a float64 / direct reference, with and without accumulation."""
    config = one_device(moe_config(layers=1, router_z_loss=1e-3, load_balance_loss=1e-2))
    batch = dict(lm_batch(config))
    weights = batch["weights"].copy()
    weights[0::2, : S // 2] = 0.0  # micro-batch 0 of 2 (rows 0, 2, ...) has prompts
    batch["weights"] = weights
    mesh = make_mesh(config, jax.devices()[:1])
    state = train.init_state(config, mesh)
    real = batch["segment_ids"] > 0

    def direct(params, accumulation):
        """LM loss per weight + router sums per real token, with no `token_mean` trick; the
        router terms of each micro-batch (rows a, a + accumulation, ...) as the step makes
        them (the balance loss is per micro-batch)."""
        model = state.model(params)
        lm_sum, router = 0.0, 0.0
        for a in range(accumulation):
            mb = {k: v[a::accumulation] for k, v in batch.items()}
            out = model.hidden_states(mb["inputs"], mb["positions"], mb["segment_ids"])
            lm_sum += lm_loss_sums(config, out.hidden, model.head_weight(), mb, None)["loss_sum"]
            router += out.aux["learning/router_z_loss"] + out.aux["learning/moe_lb_loss"]
        return lm_sum / weights.sum() + router / real.sum()

    out = state.model().hidden_states(batch["inputs"], batch["positions"], batch["segment_ids"])
    z_want = np.float64(out.aux["learning/router_z_loss"]) / real.sum()
    for accumulation in (1, 2):
        reference = jax.jit(jax.value_and_grad(direct), static_argnums=1)
        want_loss, want_grads = reference(state.params, accumulation)
        cfg = config.model_copy(
            update={
                "train": config.train.model_copy(
                    update={"gradient_accumulation_steps": accumulation}
                )
            }
        )
        loss, aux, grads = train.loss_and_grads(cfg, state, batch)
        assert rel_err(aux["learning/router_z_loss"], z_want) <= 1e-5  # 1e-5 relative (float32)
        assert rel_err(loss, want_loss) <= 1e-5  # 1e-5 relative (float32)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
            # 1e-5 relative (float32); the aux_free biases' gradients are exactly 0.
            assert np.array_equal(a, b) or rel_err(a, b) <= 1e-5


def test_registries_name_every_implementation():
    from kiln.config import ATTENTION_KERNELS
    from kiln.model.attention import IMPLEMENTATIONS

    assert set(FAMILY_SECTIONS) == set(FAMILIES)
    assert set(ATTENTION_KERNELS) == set(IMPLEMENTATIONS)
