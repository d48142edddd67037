"""The device mesh and the logical-axis rules that turn axis names into shardings.

Every array dimension in kiln carries a logical name (`embed`, `heads`, `batch`, ...);
`config.mesh.rules` maps each name to the mesh axes that split it. A mesh axis is used at
most once per array: if two dimensions of one array claim the same mesh axis, the first
dimension keeps it and the later one is replicated along it. `kiln.config.axes.resolve` is the
one place that resolves names to axes (the config's checks use it too); `logical_spec` wraps it
in a PartitionSpec, and everything else here derives from that.

Model code does not hold the mesh: `use_mesh(mesh, rules)` sets JAX's mesh (`jax.set_mesh`)
and kiln's rules for the code traced inside it, and `constrain` reads both. A jitted function
that runs model code must therefore be traced (called) inside `use_mesh`; `in_mesh` wraps one
so that every call is. The rules are not part of jit's cache key (the mesh is), so a jitted
function belongs to one set of rules: build it per config, as the trainer does.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kiln.config import DEFAULT_AXIS_RULES, MESH_AXES, check_devices
from kiln.config.axes import entry_axes, resolve, shards_per_dim, without_axis
from kiln.errors import KilnError
from kiln.util.humanize import plural

Rules = Mapping[str, Sequence[str]] | Iterable[tuple[str, Sequence[str]]]
# The rules of the innermost `use_mesh` (None outside: the defaults).
_RULES: contextvars.ContextVar[Rules | None] = contextvars.ContextVar("kiln_rules", default=None)
# The dtype weight gradients are summed across devices in, while a step is traced inside
# `grad_reduce_dtype` (`train.grad_reduce_dtype`); None: the compute dtype. Unset outside one.
_REDUCE_DTYPE: contextvars.ContextVar = contextvars.ContextVar("kiln_grad_reduce")


def make_mesh(config: Any, devices: Sequence[Any] | None = None) -> Mesh:
    """Mesh with axes (data, fsdp, tensor, sequence) sized by `config.mesh` over all devices.

    `devices` (default: every device) may be compile-only devices of a TPU topology.
    """
    sizes = check_devices(config, jax.device_count() if devices is None else len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    axis_types = (jax.sharding.AxisType.Auto,) * len(shape)
    return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)


def topology(mesh: Mesh) -> dict[str, Any]:
    """What a run runs on: processes, devices (their kind) and the mesh's axis sizes; JSON."""
    devices = mesh.devices.flat
    processes = len({d.process_index for d in devices})
    return {
        "processes": processes,
        "devices": mesh.devices.size,
        "device_kind": devices[0].device_kind,
        "mesh": {axis: int(size) for axis, size in mesh.shape.items()},
    }


def describe_topology(t: Mapping[str, Any]) -> str:
    """'2 processes x 4 cpu devices (fsdp 8)': a `topology` in words (mesh axes above 1)."""
    per_process, kind = t["devices"] // t["processes"], t["device_kind"]
    axes = ", ".join(f"{a} {n}" for a, n in t["mesh"].items() if n > 1) or "every mesh axis 1"
    return (
        f"{plural(t['processes'], 'process', 'processes')} x "
        f"{plural(per_process, f'{kind} device')} ({axes})"
    )


def traced_platform(mesh: Mesh | None = None) -> str:
    """Platform ('cpu', 'gpu', 'tpu') of `mesh`'s devices, else of the traced mesh, else JAX's default.

    A program compiled ahead of time for other devices (e.g. a TPU topology from a CPU host)
    reports those devices, not the host's backend.
    """
    if mesh is not None:
        return mesh.devices.flat[0].platform
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return device.platform if device is not None else jax.default_backend()


def logical_spec(names: tuple[str | None, ...], rules: Rules) -> PartitionSpec:
    """PartitionSpec for an array whose dimensions have these logical names (None = replicated)."""
    return PartitionSpec(*resolve(names, dict(rules)))


def logical_sharding(mesh: Mesh, rules: Rules, names: tuple[str | None, ...]) -> NamedSharding:
    """NamedSharding on `mesh` for an array with these logical dimension names."""
    return NamedSharding(mesh, logical_spec(names, rules))


def batch_sharding(mesh: Mesh, rules: Rules) -> NamedSharding:
    """Sharding of a global [batch, seq] array of token ids, positions, segment ids or weights."""
    return logical_sharding(mesh, rules, ("batch", "length"))


def mesh_axes(
    names: tuple[str | None, ...], rules: Rules, mesh_shape: Mapping[str, int]
) -> tuple[tuple[str, ...], ...]:
    """Per dimension, the mesh axes (those `mesh_shape` has) that split an array of these names."""
    return tuple(
        tuple(a for a in entry_axes(entry) if a in mesh_shape)
        for entry in logical_spec(names, rules)
    )


@contextlib.contextmanager
def use_mesh(mesh: Mesh | None, rules: Rules | None = None) -> Iterator[None]:
    """Run (and trace) model code on `mesh` with these rules (None = the defaults).

    Sets `jax.set_mesh(mesh)`, so bare PartitionSpecs resolve against it, and the rules that
    `constrain` reads. With `mesh=None` model code runs unsharded. Not usable inside jit.
    """
    with use_rules(rules), jax.set_mesh(mesh):
        yield


@contextlib.contextmanager
def use_rules(rules: Rules | None) -> Iterator[None]:
    """Trace model code with these rules on the current mesh (inside jit too): the rules inside
    pipeline stages (kiln.parallel.pipeline)."""
    token = _RULES.set(rules)
    try:
        yield
    finally:
        _RULES.reset(token)


@contextlib.contextmanager
def grad_reduce_dtype(dtype) -> Iterator[None]:
    """Trace model code whose weight gradients are computed and reduced in `dtype` (None: compute)."""
    token = _REDUCE_DTYPE.set(None if dtype is None else jnp.dtype(dtype))
    try:
        yield
    finally:
        _REDUCE_DTYPE.reset(token)


def current_reduce_dtype(default=None):
    """The weight-gradient dtype of the `grad_reduce_dtype` being traced (None: the compute
    dtype); `default` outside one."""
    return _REDUCE_DTYPE.get(default)


def current_rules() -> Rules:
    """The rules of the innermost `use_mesh` (the defaults outside one)."""
    rules = _RULES.get()
    return DEFAULT_AXIS_RULES if rules is None else rules


@dataclasses.dataclass(frozen=True)
class InMesh:
    """A jitted function whose calls, traces and lowerings run inside `use_mesh(mesh, rules)`.

    `args` are bound in front of the caller's (e.g. an objective, an argument of the compiled
    step). `trace` and `lower` are jit's own (`kiln compile`-style ahead-of-time use, jaxprs).
    """

    fn: Any
    mesh: Mesh | None
    rules: Rules | None
    args: tuple = ()

    def _run(self, method, args, kwargs):
        with use_mesh(self.mesh, self.rules):
            return method(*self.args, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        return self._run(self.fn, args, kwargs)

    def trace(self, *args, **kwargs):
        return self._run(self.fn.trace, args, kwargs)

    def lower(self, *args, **kwargs):
        return self._run(self.fn.lower, args, kwargs)


def in_mesh(fn: Any, mesh: Mesh | None, rules: Rules | None, *args: Any) -> InMesh:
    """Jitted `fn` with every call (so every trace) inside `use_mesh(mesh, rules)`; `args` bound first."""
    return InMesh(fn, mesh, rules, args)


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Pin an activation's sharding by its logical names; a no-op outside `use_mesh`."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_spec(names, current_rules()))


def gathered(w: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """A weight with these logical names gathered over the mesh axes the tokens are split over
    (the `batch` and `length` rules': FSDP's gather), still split over the others (tensor); a
    no-op outside `use_mesh`."""
    if jax.sharding.get_abstract_mesh().empty:
        return w
    rules = dict(current_rules())
    for axis in {a for name in ("batch", "length") for a in entry_axes(rules[name])}:
        rules = without_axis(rules, axis)
    return jax.lax.with_sharding_constraint(w, logical_spec(names, rules))


def param_spec(
    path: str, shape: tuple[int, ...], names: tuple, rules: Rules, sizes
) -> PartitionSpec:
    """Spec of one parameter; a dimension its mesh axes do not divide is a KilnError."""
    spec = logical_spec(tuple(names), rules)
    for dim, (n, pieces, name) in enumerate(zip(shape, shards_per_dim(spec, sizes), names)):
        if n % pieces:
            raise KilnError(
                f"mesh.rules.{name}: parameter {path} has size {n} in dimension {dim} "
                f"({name}), not divisible by the {pieces} shards of mesh axes "
                f"{spec[dim]}; change the mesh sizes or the rule for {name!r}"
            )
    return spec


def _logical_names(var: nnx.Variable, ndim: int) -> tuple[str | None, ...]:
    names = var.get_metadata().get("out_sharding") or ()
    return tuple(names) + (None,) * (ndim - len(names))


def _fits(shape: tuple[int, ...], names: tuple, rules: Rules, sizes) -> bool:
    """Whether `names` (one per dimension) shard `shape` evenly."""
    if len(names) != len(shape):
        return False
    pieces = shards_per_dim(logical_spec(tuple(names), rules), sizes)
    return all(n % p == 0 for n, p in zip(shape, pieces))


def _path_str(path: tuple) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def state_specs(
    state: Any, rules: Rules, sizes: Mapping[str, int], *, derived: bool = False
) -> Any:
    """PartitionSpec per variable of an nnx state (arrays or ShapeDtypeStructs), by the rules.

    `derived`: the state is an optimizer's, whose variables carry their parameter's logical
    names. A statistic of another shape than its parameter's (Adafactor's row and column
    means, its placeholders for unfactored parameters) is replicated: it is a sum of the
    parameter's dimensions, not their product, in size.
    """

    def spec(path, leaf):
        if isinstance(leaf, nnx.Variable):
            value = leaf.get_value()
            names = _logical_names(leaf, len(value.shape))
            if derived and not _fits(value.shape, names, rules, sizes):
                return leaf.replace(PartitionSpec())
            return leaf.replace(param_spec(_path_str(path), value.shape, names, rules, sizes))
        return PartitionSpec()

    return jax.tree_util.tree_map_with_path(
        spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )


def state_shardings(state: Any, mesh: Mesh, rules: Rules, *, derived: bool = False) -> Any:
    """NamedSharding per variable of an nnx state, matching its tree (for jit in/out_shardings);
    `derived` as in `state_specs`."""
    sizes = dict(mesh.shape)
    specs = state_specs(state, rules, sizes, derived=derived)
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s),
        specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def sharded_abstract(build: Callable[[], Any], mesh: Mesh | None, rules: Rules):
    """(graphdef, state) of the module `build()` makes: ShapeDtypeStructs, sharded by the rules.

    Nothing is allocated (`nnx.eval_shape`); without a mesh the structs carry no sharding.
    """
    graphdef, abstract = nnx.split(nnx.eval_shape(build))
    if mesh is None:
        return graphdef, abstract
    shardings = state_shardings(abstract, mesh, rules)
    return graphdef, jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings
    )


def sharded_init(build: Callable[[], Any], mesh: Mesh | None, rules: Rules):
    """The module `build()` makes, its variables created directly in the rules' shardings.

    `build` is traced twice (shapes, then values under jit with out_shardings): each device
    computes only its own shards of the random init, so no full copy exists anywhere.
    """
    graphdef, abstract = sharded_abstract(build, mesh, rules)
    shardings = None if mesh is None else jax.tree.map(lambda x: x.sharding, abstract)
    with use_mesh(mesh, rules):
        state = jax.jit(lambda: nnx.state(build()), out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def mesh_sizes_for_summary(config: Any, num_devices: int | None = None) -> dict[str, int]:
    """Mesh sizes for planning: -1 resolved against `num_devices` (default: the local devices)."""
    given = {a: getattr(config.mesh, a) for a in MESH_AXES}
    if -1 not in given.values():
        return given
    count = jax.device_count() if num_devices is None else num_devices
    return config.mesh.sizes(max(count, math.prod(s for s in given.values() if s > 0)))


def device_memory(devices: Sequence[Any]) -> tuple[int, str] | None:
    """(bytes, what they are) that `devices` hold together: the memory limit of each
    accelerator, or for CPU devices the host's physical memory, which they share; None when
    unknown. A bound for refusing work that cannot fit, not a promise that less will."""
    platform = devices[0].platform
    if platform == "cpu":
        try:
            host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, OSError, ValueError):
            return None
        return host, f"host memory (shared by {plural(len(devices), 'CPU device')})"
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices]
    if None in limits:
        return None
    return sum(limits), f"memory of {plural(len(devices), platform + ' device')}"
