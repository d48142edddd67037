"""Mesh construction and logical-axis rules -> PartitionSpecs / NamedShardings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from kiln.config import DEFAULT_AXIS_RULES, config_from_dict
from kiln.errors import KilnError
from kiln.parallel.mesh import (
    batch_sharding,
    constrain,
    gathered,
    in_mesh,
    logical_sharding,
    logical_spec,
    make_mesh,
    mesh_axes,
    sharded_init,
    state_shardings,
    use_mesh,
)


def _config(**mesh):
    return config_from_dict({"mesh": mesh, "train": {"global_batch_size": 8}})


def test_make_mesh_fills_minus_one_with_remaining_devices():
    mesh = make_mesh(_config(data=2, fsdp=-1, tensor=2, sequence=1))
    assert mesh.axis_names == ("stage", "data", "fsdp", "expert", "tensor", "sequence")
    assert dict(mesh.shape) == {
        "stage": 1,
        "data": 2,
        "fsdp": 2,
        "expert": 1,
        "tensor": 2,
        "sequence": 1,
    }
    assert mesh.devices.size == jax.device_count() == 8


def test_make_mesh_rejects_sizes_that_do_not_match_the_devices():
    with pytest.raises(KilnError, match="8 devices"):
        make_mesh(_config(data=2, fsdp=2, tensor=1, sequence=1))


def test_default_rules_map_parameter_and_activation_names():
    # Parameters' embed dimension: fsdp, sequence and expert (their devices shard state too).
    fs = ("fsdp", "sequence", "expert")
    assert logical_spec(("vocab", "embed"), DEFAULT_AXIS_RULES) == P("tensor", fs)
    assert logical_spec(("layers", "embed", "heads", "head_dim"), DEFAULT_AXIS_RULES) == P(
        None, fs, "tensor", None
    )
    assert logical_spec(("batch", "length", "act_embed"), DEFAULT_AXIS_RULES) == P(
        ("data", "fsdp", "expert"), "sequence", None
    )
    # An MoE layer's expert weights: experts over expert; embed then keeps fsdp and sequence.
    assert logical_spec(("layers", "experts", "embed", "mlp"), DEFAULT_AXIS_RULES) == P(
        None, "expert", ("fsdp", "sequence"), "tensor"
    )
    assert logical_spec((None, "mlp"), DEFAULT_AXIS_RULES) == P(None, "tensor")


def test_a_mesh_axis_is_used_once_per_array():
    rules = {**DEFAULT_AXIS_RULES, "embed": ["fsdp"], "mlp": ["fsdp", "tensor"]}
    # embed takes fsdp first; mlp keeps only tensor.
    assert logical_spec(("embed", "mlp"), rules) == P("fsdp", "tensor")
    assert logical_spec(("mlp", "embed"), rules) == P(("fsdp", "tensor"), None)


def test_unknown_logical_name_is_a_user_error():
    with pytest.raises(KilnError, match="no rule for logical axis 'expertz'"):
        logical_spec(("expertz",), DEFAULT_AXIS_RULES)


def test_batch_sharding_splits_batch_and_length():
    mesh = make_mesh(_config(data=2, fsdp=2, tensor=1, sequence=2))
    sharding = batch_sharding(mesh, DEFAULT_AXIS_RULES)
    assert sharding.spec == P(("data", "fsdp", "expert"), "sequence")
    x = jax.device_put(jnp.zeros((8, 16), jnp.int32), sharding)
    assert {s.data.shape for s in x.addressable_shards} == {(2, 8)}


def test_constrain_is_identity_without_mesh_and_pins_sharding_with_one():
    x = jnp.arange(64.0).reshape(8, 8)
    assert constrain(x, ("batch", "act_embed")) is x
    mesh = make_mesh(_config(fsdp=8))
    double = jax.jit(lambda a: constrain(a * 2, ("batch", "act_embed")))
    with use_mesh(mesh, DEFAULT_AXIS_RULES):
        y = double(x)
    assert y.sharding.is_equivalent_to(
        logical_sharding(mesh, DEFAULT_AXIS_RULES, ("batch", "act_embed")), 2
    )
    # The mesh is part of jit's cache key: outside the context the same function is unsharded.
    assert len(double(x).sharding.device_set) == 1
    np.testing.assert_array_equal(double(x), y)


def test_gathered_takes_a_weight_off_the_batchs_axes_and_keeps_the_others():
    w = jnp.arange(8.0 * 4 * 2).reshape(8, 4, 2)
    names = ("embed", "heads", "head_dim")
    assert gathered(w, names) is w
    mesh = make_mesh(_config(fsdp=4, tensor=2))
    with use_mesh(mesh, DEFAULT_AXIS_RULES):
        y = jax.jit(lambda a: gathered(a * 1, names))(
            jax.device_put(w, logical_sharding(mesh, DEFAULT_AXIS_RULES, names))
        )
    # Stored split over the token axes (fsdp, sequence, expert) on `embed`, and tensor on heads.
    assert logical_spec(names, DEFAULT_AXIS_RULES)[:2] == (("fsdp", "sequence", "expert"), "tensor")
    assert y.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, P(None, "tensor")), 3)
    np.testing.assert_array_equal(y, w)


def test_use_mesh_sets_the_rules_that_constrain_reads_and_restores_them():
    mesh = make_mesh(_config(data=2, fsdp=2, tensor=2))
    rules = {**DEFAULT_AXIS_RULES, "act_embed": ["tensor"], "batch": ["fsdp"]}
    names = ("batch", "act_embed")
    x = jnp.arange(64.0).reshape(8, 8)
    # One jitted function per set of rules: the rules are read when it is traced.
    pinned = in_mesh(jax.jit(lambda a: constrain(a + 1, names)), mesh, rules)
    assert pinned(x).sharding.spec == P("fsdp", "tensor")
    with use_mesh(mesh, DEFAULT_AXIS_RULES):
        with use_mesh(mesh, rules):
            inner = jax.jit(lambda a: constrain(a + 1, names))(x)
        outer = jax.jit(lambda a: constrain(a + 2, names))(x)
    assert inner.sharding.spec == P("fsdp", "tensor")
    assert outer.sharding.is_equivalent_to(logical_sharding(mesh, DEFAULT_AXIS_RULES, names), 2)
    assert jax.sharding.get_abstract_mesh().empty  # nothing leaks out of the context


def test_mesh_axes_derive_from_logical_spec():
    rules = {**DEFAULT_AXIS_RULES, "length": ["fsdp"], "vocab": ["tensor", "fsdp"]}
    shape = {"data": 1, "fsdp": 4, "tensor": 2}  # no sequence axis: left out
    assert mesh_axes(("batch", "length", "vocab"), rules, shape) == (
        ("data", "fsdp"),
        (),
        ("tensor",),
    )
    assert mesh_axes(("vocab",), rules, shape) == (("tensor", "fsdp"),)
    assert mesh_axes(("length",), DEFAULT_AXIS_RULES, shape) == ((),)


def test_sharded_init_places_each_variable_by_the_rules_with_the_unsharded_values():
    class Tiny(nnx.Module):
        def __init__(self, *, rngs: nnx.Rngs):
            value = jax.random.normal(rngs.params(), (8, 4))
            self.w = nnx.Param(value, out_sharding=("embed", "mlp"), eager_sharding=False)

    mesh = make_mesh(_config(fsdp=4, tensor=2))
    sharded = sharded_init(lambda: Tiny(rngs=nnx.Rngs(3)), mesh, DEFAULT_AXIS_RULES)
    plain = sharded_init(lambda: Tiny(rngs=nnx.Rngs(3)), None, DEFAULT_AXIS_RULES)
    assert sharded.w.get_value().sharding.spec == P(("fsdp", "sequence", "expert"), "tensor")
    assert {s.data.shape for s in sharded.w.get_value().addressable_shards} == {(2, 2)}
    # Bitwise: threefry random bits do not depend on how the output is partitioned.
    np.testing.assert_array_equal(sharded.w.get_value(), plain.w.get_value())


def test_state_shardings_follow_variable_names_and_reject_uneven_splits():
    class Tiny(nnx.Module):
        def __init__(self, rows: int):
            self.w = nnx.Param(
                jnp.zeros((rows, 4)), out_sharding=("embed", "mlp"), eager_sharding=False
            )

    mesh = make_mesh(_config(fsdp=4, tensor=2))
    state = nnx.state(Tiny(8))
    shardings = state_shardings(state, mesh, DEFAULT_AXIS_RULES)
    assert shardings["w"].get_value().spec == P(("fsdp", "sequence", "expert"), "tensor")
    with pytest.raises(KilnError, match=r"mesh\.rules\.embed: parameter w has size 6"):
        state_shardings(nnx.state(Tiny(6)), mesh, DEFAULT_AXIS_RULES)


def _param_bytes_per_device(**mesh) -> int:
    """Bytes of the default model's parameters held by one device under the default rules."""
    from kiln.model import abstract_state

    config = config_from_dict({"model": {"d_model": 64, "num_heads": 4, "d_ff": 128}, "mesh": mesh})
    state = abstract_state(config.model)
    shardings = state_shardings(state, make_mesh(config), config.mesh.rules)
    return sum(
        np.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
        for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(shardings))
    )


def test_sequence_devices_shard_parameters_like_fsdp_devices():
    # Sequence-parallel devices hold different tokens of the same batch rows: they split the
    # parameters (and so the optimizer state, sharded alike) instead of replicating them.
    split = _param_bytes_per_device(fsdp=4, sequence=2)
    assert split == _param_bytes_per_device(fsdp=8)
    assert split < _param_bytes_per_device(fsdp=4, data=2)
