"""The mesh axes, declared once: their names, the default logical-axis rules, the `mesh` section
of the config (one size field per axis, and the rules), and the one resolver from logical axis
names to mesh axes (`resolve`), which the config's checks and `kiln.parallel.mesh` both use."""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import pydantic
from pydantic import Field

from kiln.config.schema import INT32_MAX, Section
from kiln.errors import KilnError

# The mesh axes in mesh order, each with its default size and what it splits. The axis names,
# the values a rule may name and MeshConfig's size fields are all built from this table.
_MESH_AXES: dict[str, tuple[int, str]] = {
    "stage": (
        1,
        "Pipeline stages (the block stack's layers split into stages that pass micro-batches on; the outermost axis, for links between pods; see docs/pipeline.md)",
    ),
    "data": (1, "Data-parallel size (replicated params)"),
    "fsdp": (-1, "Fully-sharded data-parallel size (params sharded, batch split)"),
    "expert": (
        1,
        "Expert-parallel size (a Mixture-of-Experts layer's experts split, tokens sent to them by all-to-all; elsewhere it splits the batch and shards params like fsdp)",
    ),
    "tensor": (1, "Tensor-parallel size (heads, MLP and vocab split)"),
    "sequence": (1, "Sequence-parallel size (activations split along length)"),
}
MESH_AXES: tuple[str, ...] = tuple(_MESH_AXES)
MeshAxis = Literal[MESH_AXES]  # type: ignore[valid-type]

DEFAULT_AXIS_RULES: dict[str, list[str]] = {
    # Parameters. The embed dimension is split over sequence and expert as well as fsdp: their
    # devices hold different tokens, so they shard parameters and optimizer state like fsdp
    # devices (replicating them would multiply the state per device).
    "vocab": ["tensor"],
    "embed": ["fsdp", "sequence", "expert"],
    "heads": ["tensor"],
    "kv_heads": ["tensor"],
    "head_dim": [],
    "mlp": ["tensor"],
    # The block stack's layer axis: whole on every device; with pipeline stages (mesh.stage
    # other than 1) the stage axis is put in front, consecutive layers per stage (_Mesh).
    "layers": [],
    # The layer axis of the stacks that run outside pipeline stages, on every stage: the moe
    # family's first dense blocks and DeepSeek's multi-token prediction modules.
    "unstaged_layers": [],
    "norm": [],
    # A Mixture-of-Experts layer's expert dimension (its weights [experts, embed, mlp]: embed
    # then takes only the axes experts left, as every later dimension does).
    "experts": ["expert"],
    # Activations.
    "batch": ["data", "fsdp", "expert"],
    "length": ["sequence"],
    # The residual stream's length (block boundaries, norm inputs): split over tensor as well,
    # so tensor-parallel devices hold different tokens between sub-layers (sequence
    # parallelism) and each projection's partial sums are reduce-scattered, not all-reduced.
    "act_length": ["sequence", "tensor"],
    "act_embed": [],
    "act_heads": ["tensor"],
    "act_kv_heads": ["tensor"],
    "act_mlp": ["tensor"],
    "act_vocab": ["tensor"],
}


def _mesh_size(v: int) -> int:
    if v == 0:
        raise ValueError("a mesh size is a positive integer or -1 (fill)")
    return v


class _Mesh(Section):
    """Device mesh sizes and the logical-axis -> mesh-axis rules."""

    @pydantic.model_validator(mode="before")
    @classmethod
    def _stages_split_the_layers(cls, raw: Any) -> Any:
        """With pipeline stages the block stack's layers are split over `stage` first, and
        (unless the config's `batch` rule is not the default) so is the batch outside the
        stages: the embedding, the layers outside the stages, the LM head and the loss then
        run on each stage's rows, not on the whole batch on every stage, and the processes of
        a run split over stages read different rows (`kiln.parallel.pipeline.stack` gathers a
        stage's rows before the stages and splits them after)."""
        if not isinstance(raw, Mapping) or raw.get("stage", 1) == 1:
            return raw
        rules = dict(raw.get("rules") or {})
        layers = list(rules.get("layers", DEFAULT_AXIS_RULES["layers"]))
        if "stage" not in layers:
            rules["layers"] = ["stage", *layers]
        if list(rules.get("batch", DEFAULT_AXIS_RULES["batch"])) == DEFAULT_AXIS_RULES["batch"]:
            rules["batch"] = ["stage", *DEFAULT_AXIS_RULES["batch"]]
        return {**raw, "rules": rules}

    @pydantic.field_validator("rules", check_fields=False)
    @classmethod
    def _rules(cls, rules: dict[str, list[str]]) -> dict[str, list[str]]:
        for name, axes in rules.items():
            if name not in DEFAULT_AXIS_RULES:
                close = difflib.get_close_matches(name, DEFAULT_AXIS_RULES, n=1, cutoff=0.6)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ValueError(
                    f"unknown key 'mesh.rules.{name}': {hint}allowed: {', '.join(DEFAULT_AXIS_RULES)}"
                )
            if len(set(axes)) != len(axes):
                raise ValueError(f"rule {name!r} repeats a mesh axis: {axes}")
        return {**{k: list(v) for k, v in DEFAULT_AXIS_RULES.items()}, **rules}

    def sizes(self, num_devices: int) -> dict[str, int]:
        """Mesh axis sizes with -1 resolved against `num_devices`."""
        given = {a: getattr(self, a) for a in MESH_AXES}
        fill = [a for a, s in given.items() if s == -1]
        known = math.prod(s for s in given.values() if s != -1)
        if fill:
            if num_devices % known:
                raise KilnError(
                    f"mesh: sizes {given} leave {num_devices} devices / {known} = "
                    f"{num_devices / known:g} for mesh.{fill[0]}=-1; it must be a whole number"
                )
            given[fill[0]] = num_devices // known
        elif known != num_devices:
            raise KilnError(
                f"mesh: {'*'.join(MESH_AXES)} = {known} but {num_devices} devices are "
                "present; make the product equal the device count or set one size to -1"
            )
        return given


_MeshSize = Annotated[int, Field(ge=-1, le=INT32_MAX), pydantic.AfterValidator(_mesh_size)]

MeshConfig: Any = pydantic.create_model(
    "MeshConfig",
    __base__=_Mesh,
    __module__=__name__,
    __doc__=_Mesh.__doc__,
    **{
        axis: (_MeshSize, Field(default, description=f"{what}; -1 = fill the remaining devices."))
        for axis, (default, what) in _MESH_AXES.items()
    },
    rules=(
        dict[str, list[MeshAxis]],
        Field(
            default_factory=lambda: {k: list(v) for k, v in DEFAULT_AXIS_RULES.items()},
            description="Logical axis name -> mesh axes that shard it ([] = replicated). Keys given here replace the defaults one by one.",
        ),
    ),
)


# A dimension's mesh axes as a PartitionSpec entry: None, one axis name, or a tuple of them.
SpecEntry = str | tuple[str, ...] | None


def resolve(names: tuple[str | None, ...], rules: Mapping[str, list[str]]) -> tuple[SpecEntry, ...]:
    """PartitionSpec entries for an array whose dimensions have these logical names (None =
    replicated). A mesh axis claimed by an earlier dimension is not used again by a later one."""
    used: set[str] = set()
    spec: list[SpecEntry] = []
    for name in names:
        if name is None:
            spec.append(None)
            continue
        if name not in rules:
            raise KilnError(
                f"mesh.rules: no rule for logical axis {name!r}; known: {', '.join(sorted(rules))}"
            )
        axes = tuple(a for a in rules[name] if a not in used)
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return tuple(spec)


def without_axis(rules: Mapping[str, list[str]], axis: str) -> dict[str, list[str]]:
    """`rules` with `axis` taken out of every rule: the rules inside pipeline stages, where each
    stage computes alone and `stage` splits nothing (kiln.parallel.pipeline)."""
    return {name: [a for a in axes if a != axis] for name, axes in rules.items()}


def entry_axes(entry: SpecEntry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry, as a tuple."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def shards_per_dim(spec: tuple[SpecEntry, ...], sizes: Mapping[str, int]) -> tuple[int, ...]:
    """How many pieces each dimension is cut into by `spec` on a mesh of these axis sizes."""
    return tuple(math.prod(sizes[a] for a in entry_axes(entry)) for entry in spec)
