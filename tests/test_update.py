"""One optimizer update (`kiln.training.train.make_update`) against optax's own AdamW on the real tree.

kiln chains clipping, Adam scaling and decoupled weight decay in optax and applies the
learning rate outside it (see `kiln.training.optim.make_optimizer`); the reference below is optax's
stock `clip_by_global_norm` + `adamw(mask=...)`, with a mask written here independently.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from optax.contrib._muon import scale_by_shape

from conftest import make_config
from kiln.parallel.mesh import make_mesh
from kiln.training import train
from kiln.training.optim import decay_mask

LR, B1, B2, EPS, WD, CLIP = 1e-2, 0.8, 0.9, 1e-6, 0.1, 0.5
MODEL = {
    "vocab_size": 128, "d_model": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
    "d_ff": 64, "max_seq_len": 16, "qk_norm": True,
}  # fmt: skip
OPTIM = {
    "learning_rate": LR, "schedule": "constant", "warmup_steps": 0, "b1": B1, "b2": B2,
    "eps": EPS, "weight_decay": WD, "grad_clip": CLIP,
}  # fmt: skip


def no_decay(path) -> bool:
    """Norm scales (attn/mlp/final norms and the per-head q_norm/k_norm) are not decayed."""
    keys = [str(getattr(k, "key", k)) for k in path]
    return keys[-1] == "scale" and any(k.endswith("norm") for k in keys[:-1])


def reference_mask(tree):
    return jax.tree_util.tree_map_with_path(lambda path, _: not no_decay(path), tree)


def host(tree):
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


@pytest.fixture(scope="module")
def setup():
    config = make_config(model=MODEL, optim=OPTIM, data={"seq_len": 16}, mesh={"fsdp": -1})
    state = train.init_state(config)
    return config, state


def reference_step(reference: optax.GradientTransformation):
    """optax's `update` then `apply_updates`, jitted: one program, not one per eager op."""

    @jax.jit
    def step(grads, opt_state, params):
        updates, opt_state = reference.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def random_grads(params, seed: int, scale: float):
    """Gradients with the params' tree and shardings; global norm about scale * sqrt(size)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda p: jax.device_put(
            (scale * rng.standard_normal(p.shape)).astype(np.float32), p.sharding
        ),
        params,
    )


def test_mask_excludes_exactly_the_norm_scales(setup):
    config, state = setup
    got = nnx.to_pure_dict(decay_mask(state.params, config.optim))
    paths = {
        jax.tree_util.keystr(path): (keep, not no_decay(path))
        for path, keep in jax.tree_util.tree_leaves_with_path(got)
    }
    assert {p for p, (keep, _) in paths.items() if not keep} >= {
        "['blocks']['attn']['q_norm']['scale']",
        "['blocks']['attn']['k_norm']['scale']",
        "['final_norm']['scale']",
    }
    assert all(keep == want for keep, want in paths.values()), paths


@pytest.mark.parametrize("scale", [1e-2, 1e-4], ids=["clipped", "below-clip"])
def test_two_updates_match_optax_adamw(setup, scale):
    config, state = setup
    update = jax.jit(train.make_update(config))
    params0 = host(nnx.to_pure_dict(state.params))
    reference = optax.chain(
        optax.clip_by_global_norm(CLIP),
        optax.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD, mask=reference_mask),
    )
    ref_params = jax.tree.map(jnp.asarray, params0)
    ref_opt, ref_step = reference.init(ref_params), reference_step(reference)
    aux = {"learning/z_loss": jnp.float32(0.0125), "learning/total_weights": jnp.float32(96.0)}
    for step, seed in enumerate((1, 2), start=1):
        grads = random_grads(state.params, seed, scale)
        state, metrics = update(state, jnp.float32(2.5 + step), aux, grads)
        g = host(nnx.to_pure_dict(grads))
        ref_params, ref_opt = ref_step(jax.tree.map(jnp.asarray, g), ref_opt, ref_params)

        got, want = host(nnx.to_pure_dict(state.params)), host(ref_params)
        for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
            # f32: the same operations in the same order up to where lr multiplies; an update
            # is ~lr = 1e-2 on parameters of ~0.02..1, so 1e-6 relative + 1e-7 absolute.
            np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7, err_msg=str(path))

        raw = np.sqrt(sum(np.sum(np.square(x, dtype=np.float64)) for x in jax.tree.leaves(g)))
        m = host(metrics)
        # f32 sum of squares over ~30k entries against float64: 1e-5 relative.
        np.testing.assert_allclose(m["learning/raw_grad_norm"], raw, rtol=1e-5)
        np.testing.assert_allclose(m["learning/grad_norm"], min(raw, CLIP), rtol=1e-5)
        assert (raw > CLIP) == (scale == 1e-2)  # each case exercises the branch it names
        np.testing.assert_allclose(m["learning/current_learning_rate"], LR, rtol=1e-6)
        assert m["learning/loss"] == np.float32(2.5 + step)
        assert m["learning/z_loss"] == np.float32(0.0125)
        assert m["learning/total_weights"] == np.float32(96.0)
        assert m["learning/step_skipped"] == 0.0 and int(state.step) == step
        param_norm = np.sqrt(
            sum(np.sum(np.square(x, dtype=np.float64)) for x in jax.tree.leaves(got))
        )
        np.testing.assert_allclose(m["learning/param_norm"], param_norm, rtol=1e-5)


def test_weight_decay_would_show_on_the_norm_scales(setup):
    """The mask matters at the test's tolerance: decaying the q_norm scales (~1) would move
    them by lr * wd * 1 = 1e-3 per step, far above the 1e-6 compared above."""
    config, state = setup
    update = jax.jit(train.make_update(config))
    zero = jax.tree.map(jnp.zeros_like, state.params)
    aux = {"learning/z_loss": jnp.float32(0.0), "learning/total_weights": jnp.float32(1.0)}
    new, _ = update(state, jnp.float32(1.0), aux, zero)
    before, after = host(nnx.to_pure_dict(state.params)), host(nnx.to_pure_dict(new.params))
    q_norm = ("blocks", "attn", "q_norm", "scale")
    b, a = before, after
    for k in q_norm:
        b, a = b[k], a[k]
    np.testing.assert_array_equal(a, b)  # zero gradient, no decay: unchanged
    # Decayed kernels shrink by exactly (1 - lr * wd) under a zero gradient (Adam's part is 0).
    np.testing.assert_allclose(
        after["lm_head"], before["lm_head"] * (1 - LR * WD), rtol=1e-6, atol=1e-9
    )


# ---------------------------------------------------------------------------------------------
# Every optimizer (optim.name) against its optax chain built here by hand on plain dicts: the
# weight-decay mask and Muon's matrices and their axes written from the paths, the learning
# rate applied by optax.scale(-lr); kiln reads the roles its model declares instead.

MUON = {"ns_steps": 4, "beta": 0.9, "nesterov": True, "rms_scale": 0.3}
ADAFACTOR = {"decay_rate": 0.7, "clipping_threshold": 0.9, "eps": 1e-29, "min_dim_size_to_factor": 32}  # fmt: skip
LION = {"b1": 0.85, "b2": 0.98}
# Muon's matrices: (input axes, output axes) of each stacked [layers, ...] weight.
MATRIX_AXES = {
    "wq": ((1,), (2, 3)), "wk": ((1,), (2, 3)), "wv": ((1,), (2, 3)), "wo": ((1, 2), (3,)),
    "w_gate": ((1,), (2,)), "w_up": ((1,), (2,)), "w_down": ((1,), (2,)),
}  # fmt: skip


def leaf_name(path) -> str:
    return str(getattr(path[-1], "key", path[-1]))


def reference_direction(name: str) -> optax.GradientTransformation:
    adam = optax.scale_by_adam(b1=B1, b2=B2, eps=EPS)
    if name == "adamw":
        return adam
    if name == "lion":
        return optax.scale_by_lion(b1=LION["b1"], b2=LION["b2"])
    if name == "adafactor":
        return optax.chain(
            optax.scale_by_factored_rms(
                decay_rate=ADAFACTOR["decay_rate"],
                epsilon=ADAFACTOR["eps"],
                min_dim_size_to_factor=ADAFACTOR["min_dim_size_to_factor"],
            ),
            optax.clip_by_block_rms(ADAFACTOR["clipping_threshold"]),
        )

    def labels(tree):
        return jax.tree_util.tree_map_with_path(
            lambda p, _: "muon" if leaf_name(p) in MATRIX_AXES else "adam", tree
        )

    def axes(tree):
        def dims(path, x):
            into, out = MATRIX_AXES[leaf_name(path)]
            return optax.contrib.MuonDimensionNumbers(into, out)

        return jax.tree_util.tree_map_with_path(dims, tree)

    # Muon's updates scaled to AdamW's RMS by optax's own `scale_by_shape`, the step
    # `optax.contrib.muon(consistent_rms=...)` chains after `scale_by_muon` (optax 0.2.8 does
    # not export it from optax.contrib). The whole `optax.contrib.muon` is no reference here:
    # its Adam half is Nesterov's when Muon's is and decays every parameter, norms too.
    muon = optax.chain(
        optax.contrib.scale_by_muon(
            ns_steps=MUON["ns_steps"],
            beta=MUON["beta"],
            nesterov=MUON["nesterov"],
            weight_dimension_numbers=axes,
        ),
        scale_by_shape(weight_dimension_numbers=axes, consistent_rms=MUON["rms_scale"]),
    )
    return optax.partition({"muon": muon, "adam": adam}, labels)


@pytest.mark.parametrize("mesh", [{"fsdp": 1}, {"fsdp": 4, "tensor": 2}], ids=["1-device", "fsdp4xtensor2"])  # fmt: skip
@pytest.mark.parametrize("name", ["adamw", "muon", "adafactor", "lion"])
def test_each_optimizer_matches_its_optax_chain_by_hand(name, mesh):
    optim = {**OPTIM, "name": name, **({name: globals()[name.upper()]} if name != "adamw" else {})}
    config = make_config(model=MODEL, optim=optim, data={"seq_len": 16}, mesh=mesh)
    devices = jax.devices()[: int(np.prod(list(mesh.values())))]
    state = train.init_state(config, make_mesh(config, devices))
    update = jax.jit(train.make_update(config))
    reference = optax.chain(
        optax.clip_by_global_norm(CLIP),
        reference_direction(name),
        optax.add_decayed_weights(WD, mask=reference_mask),
        optax.scale(-LR),
    )
    ref_params = jax.tree.map(jnp.asarray, host(nnx.to_pure_dict(state.params)))
    ref_opt, ref_step = reference.init(ref_params), reference_step(reference)
    aux = {"learning/z_loss": jnp.float32(0.0), "learning/total_weights": jnp.float32(1.0)}
    for step, seed in enumerate((1, 2), start=1):
        grads = random_grads(state.params, seed, 1e-2)
        state, _ = update(state, jnp.float32(1.0), aux, grads)
        g = jax.tree.map(jnp.asarray, host(nnx.to_pure_dict(grads)))
        ref_params, ref_opt = ref_step(g, ref_opt, ref_params)
        got, want = host(nnx.to_pure_dict(state.params)), host(ref_params)
        for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
            # f32, the same operations; sharded, the reductions (norms, Newton-Schulz matmuls)
            # add in another order, and Muon's RMS scale is a float32 product in optax against
            # a float64 one rounded once in kiln (1 ulp): an update is ~lr = 1e-2 on parameters
            # of ~0.02..1, so 1e-6 relative + 1e-7 absolute.
            np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7, err_msg=f"{step} {path}")


def test_muon_matrices_decay_by_their_own_rate():
    """optim.muon.weight_decay decays Muon's matrices; optim.weight_decay stays the AdamW
    part's: the hand-built chain with one decay per group, masks written from the paths."""
    matrix_wd = 0.3
    optim = {**OPTIM, "name": "muon", "muon": {**MUON, "weight_decay": matrix_wd}}
    config = make_config(model=MODEL, optim=optim, data={"seq_len": 16}, mesh={"fsdp": 1})
    state = train.init_state(config, make_mesh(config, jax.devices()[:1]))
    update = jax.jit(train.make_update(config))

    def matrices(tree):
        return jax.tree_util.tree_map_with_path(lambda p, _: leaf_name(p) in MATRIX_AXES, tree)

    def rest(tree):
        return jax.tree.map(lambda d, m: d and not m, reference_mask(tree), matrices(tree))

    reference = optax.chain(
        optax.clip_by_global_norm(CLIP),
        reference_direction("muon"),
        optax.add_decayed_weights(matrix_wd, mask=matrices),
        optax.add_decayed_weights(WD, mask=rest),
        optax.scale(-LR),
    )
    ref_params = jax.tree.map(jnp.asarray, host(nnx.to_pure_dict(state.params)))
    ref_opt = reference.init(ref_params)
    aux = {"learning/z_loss": jnp.float32(0.0), "learning/total_weights": jnp.float32(1.0)}
    grads = random_grads(state.params, 1, 1e-2)
    state, _ = update(state, jnp.float32(1.0), aux, grads)
    g = jax.tree.map(jnp.asarray, host(nnx.to_pure_dict(grads)))
    want = host(reference_step(reference)(g, ref_opt, ref_params)[0])
    got = host(nnx.to_pure_dict(state.params))
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        # f32, one device, the same operations but Muon's RMS scale (see above): 1e-6 relative
        # + 1e-7 absolute.
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7, err_msg=str(path))


def test_the_optimizer_registry_is_what_the_schema_allows():
    """One entry per `optim.name`, each with the name the summary gives its state."""
    import typing

    from kiln.config import OptimConfig
    from kiln.training.optim import OPTIMIZERS, state_name

    allowed = typing.get_args(OptimConfig.model_fields["name"].annotation)
    assert set(OPTIMIZERS) == set(allowed)
    for name in allowed:
        assert state_name(OptimConfig(name=name)) == OPTIMIZERS[name].state
