"""The run configuration: the frozen Config of all sections, YAML loading with `base_config`,
overrides, and errors that name every problem at once (the rules between fields are in
kiln.config.rules)."""

from __future__ import annotations

import difflib
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pydantic
import yaml
from pydantic import BaseModel, Field

from kiln.config.axes import MeshConfig
from kiln.config.rules import cross_field_errors
from kiln.config.schema import (
    PER_SOURCE,
    CheckpointConfig,
    DataConfig,
    DistillationConfig,
    DistributedConfig,
    LoggingConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    PipelineConfig,
    Section,
    TrainConfig,
)
from kiln.data.resolve import resolve_data_fields
from kiln.errors import KilnError
from kiln.util.storage import mirror_root


class Config(Section):
    """A whole run."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="Model shape and numerics.")
    mesh: MeshConfig = Field(
        default_factory=MeshConfig, description="Device mesh and sharding rules."
    )
    pipeline: PipelineConfig = Field(
        default_factory=PipelineConfig, description="Pipeline parallelism (mesh.stage)."
    )
    data: DataConfig = Field(default_factory=DataConfig, description="Training data.")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizer and schedule.")
    loss: LossConfig = Field(default_factory=LossConfig, description="Loss function.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Training loop.")
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Checkpointing."
    )
    distillation: DistillationConfig = Field(
        default_factory=DistillationConfig, description="Distillation."
    )
    distributed: DistributedConfig = Field(
        default_factory=DistributedConfig, description="Multi-process setup."
    )
    logging: LoggingConfig = Field(
        default_factory=LoggingConfig, description="Console and performance reporting."
    )

    @pydantic.model_validator(mode="after")
    def _cross_field(self) -> Config:
        problems = list(cross_field_errors(self))
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def __hash__(self) -> int:
        # Static data of compiled steps (jit's cache key); fields hold lists, so hash their JSON.
        return hash(self.model_dump_json())

    @property
    def local_output_dir(self) -> Path:
        """Where run directories are on this machine: output_dir, or its mirror for a URL."""
        return mirror_root(self.train.output_dir, self.train.mirror_dir)

    @property
    def run_dir(self) -> Path:
        return self.local_output_dir / self.train.run_name

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def check_devices(config: Config, num_devices: int) -> dict[str, int]:
    """Validate the config against the devices present; returns the resolved mesh sizes."""
    problems = list(cross_field_errors(config, num_devices=num_devices))
    if problems:
        raise KilnError("\n".join(problems))
    return config.mesh.sizes(num_devices)


# ---------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Read YAML (following `base_config`), apply `a.b=c` overrides, validate, then fill in what
    the data decides (`model.vocab_size: auto`, the tokenizer of shards); raises KilnError."""
    raw = _load_yaml_tree(Path(path), stack=())
    for item in overrides:
        layer: dict[str, Any] = {}
        _apply_override(layer, item)
        raw = _without_replaced(raw, layer)
        _apply_override(raw, item)
    config = config_from_dict(raw)
    resolved = resolve_data_fields(raw, config)
    return config if resolved is None else config_from_dict(resolved)


def yaml_layers(path: str | Path, overrides: Sequence[str] = ()) -> list[tuple[str, dict]]:
    """(origin, what it sets) of a config's base_config chain (first base first), the file,
    then each override ("override a.b=c")."""
    files: list[tuple[Path, dict[str, Any]]] = []
    _load_yaml_tree(Path(path), stack=(), layers=files)
    layers = [(str(file), tree) for file, tree in files]
    for item in overrides:
        tree: dict[str, Any] = {}
        _apply_override(tree, item)
        layers.append((f"override {item}", tree))
    return layers


def replaced_by_sources(
    layers: Sequence[tuple[str, Mapping[str, Any]]],
) -> dict[str, tuple[str, str]]:
    """`data.FIELD` -> (the layer that set it, the later layer whose `data.sources` replaced it),
    for every single-source field a mixture replaced (see `_without_replaced`)."""
    set_by: dict[str, str] = {}
    replaced: dict[str, tuple[str, str]] = {}
    for origin, tree in layers:
        data = tree.get("data")
        if not isinstance(data, Mapping):
            continue
        if "sources" in data:
            replaced.update({f"data.{f}": (setter, origin) for f, setter in set_by.items()})
            set_by = {}
        for field in PER_SOURCE:
            if field in data:
                set_by[field] = origin
                replaced.pop(f"data.{field}", None)
    return replaced


def read_run_config(run_dir: str | Path, context: str) -> Config:
    """The resolved `config.yaml` of a run directory; a KilnError starting with `context`."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise KilnError(f"{context}: {run_dir} has no config.yaml; is it a kiln run directory?")
    try:
        return load_config(path)
    except KilnError as e:
        raise KilnError(f"{context}: unreadable config {path}: {str(e).splitlines()[0]}") from None


def config_from_dict(raw: Mapping[str, Any]) -> Config:
    """Validate a nested dict into a Config; raises KilnError with one line per problem."""
    try:
        return Config.model_validate(dict(raw))
    except pydantic.ValidationError as e:
        raise KilnError("\n".join(_problems(raw, e))) from None


def _load_yaml_tree(
    path: Path, stack: tuple[Path, ...], layers: list | None = None
) -> dict[str, Any]:
    """The merged tree of `path` and its base_config chain; `layers` collects (file, own tree)
    from the first base to `path` (kiln.config.explain)."""
    path = path.expanduser()
    resolved = path.resolve()
    if resolved in stack:
        chain = " -> ".join(str(p) for p in (*stack, resolved))
        raise KilnError(f"base_config: loop detected: {chain}")
    if not path.is_file():
        raise KilnError(f"config file not found: {path}")
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise KilnError(f"{path}:{where}: invalid YAML: {problem}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise KilnError(f"cannot read config {path}: {e}") from None
    if data is None:
        raise KilnError(
            f"{path}: the config file is empty; allowed: a mapping of sections (`{{}}` for all "
            "defaults)"
        )
    if not isinstance(data, dict):
        raise KilnError(
            f"{path}: the top level must be a mapping of sections, got {type(data).__name__}"
        )
    base = data.pop("base_config", None)
    if base is not None and not isinstance(base, str):
        raise KilnError(f"{path}: base_config must be a path string, got {base!r}")
    parent = {} if base is None else _load_yaml_tree(path.parent / base, (*stack, resolved), layers)
    if layers is not None:
        layers.append((path, data))
    return _deep_merge(_without_replaced(parent, data), data)


def _without_replaced(below: dict[str, Any], layer: Mapping[str, Any]) -> dict[str, Any]:
    """`below` without its single-source data fields (data.source, data.paths, ...) when `layer`
    sets `data.sources`: a mixture replaces the one source a base config or an earlier override
    gives. Both set in one layer are still refused (kiln.config.schema.data)."""
    data, mine = below.get("data"), layer.get("data")
    if not (isinstance(data, Mapping) and isinstance(mine, Mapping) and "sources" in mine):
        return below
    return {**below, "data": {k: v for k, v in data.items() if k not in PER_SOURCE}}


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            lines: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = lines.get(key)
                except TypeError:  # an unhashable key: the base class reports it
                    continue
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"duplicate key {key!r} (first at line {first}); give each key once",
                        key_node.start_mark,
                    )
                lines[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _deep_merge(dict(out[k]), v)
        else:
            out[k] = v
    return out


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise KilnError(f"override {item!r}: expected KEY=VALUE, e.g. loss.z_loss_multiplier=1e-4")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as e:
        if text.lstrip()[:1] in "[{":
            raise KilnError(_quoting_hint(item, key, text, e)) from None
        value = text  # a plain word YAML cannot read (e.g. *.md): the text as it is
    parts = key.split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise KilnError(f"override {item!r}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def _quoting_hint(item: str, key: str, text: str, e: yaml.YAMLError) -> str:
    """A list or mapping override that is not valid YAML: usually an unquoted glob or colon."""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    inner = [p.strip().strip("'\"") for p in text.strip().strip("[]{}").split(",") if p.strip()]
    quoted = ", ".join(f'"{p}"' for p in inner) if inner else '"a", "b"'
    return (
        f"override {item!r}: {text!r} is not valid YAML ({problem}); in a list, quote items "
        f"that start with * & ! % @ or hold ': ', e.g. '{key}=[{quoted}]' (single quotes "
        "around the whole argument keep the shell away from it; one path needs no list: "
        f"'{key}={inner[0] if inner else 'PATH'}')"
    )


def _problems(raw: Mapping[str, Any], e: pydantic.ValidationError) -> list[str]:
    """Every problem of `raw`: the fields' own, then the rules between the valid sections."""
    field_errors = [err for err in e.errors() if err["loc"]]  # () is the rules' validator
    failed = {err["loc"][0] for err in field_errors}
    valid = {
        name: field.annotation.model_validate(raw.get(name, {}))
        for name, field in Config.model_fields.items()
        if name not in failed
    }
    rules = cross_field_errors(Config.model_construct(**valid), valid=valid.keys())
    return [*map(_field_line, field_errors), *rules]


def _field_line(err: Mapping[str, Any]) -> str:
    if err["type"] == "extra_forbidden":
        return _unknown_key(err["loc"])
    loc = ".".join(str(p) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if msg.startswith("unknown key "):  # a key inside a dict field (mesh.rules) names itself
        return msg
    if msg.startswith(f"{loc}."):  # a section's own rule names the field, value and choices
        return msg
    return f"{loc}: got {_short(err.get('input'))}; {msg}{_describe_allowed(err)}"


def _describe_allowed(err: Mapping[str, Any]) -> str:
    expected = (err.get("ctx") or {}).get("expected")
    return "" if expected is None or expected in err["msg"] else f" (allowed: {expected})"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _unknown_key(loc: tuple[Any, ...]) -> str:
    model: type[BaseModel] = Config
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        ann = field.annotation if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            break
        model = ann
    name = str(loc[-1])
    dotted = ".".join(str(p) for p in loc)
    known = list(model.model_fields)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown key {dotted!r}: {hint}allowed: {', '.join(known)}"


# ---------------------------------------------------------------------------------------------
# Schema listing


def schema_rows(
    model: type[BaseModel] = Config, prefix: str = ""
) -> list[tuple[str, str, str, str]]:
    """(dotted name, type, default, description) of every field, sections expanded."""
    rows = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        dotted = f"{prefix}{name}"
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows.extend(schema_rows(ann, prefix=f"{dotted}."))
            continue
        default = field.get_default(call_default_factory=True)
        (item,) = typing.get_args(ann) if typing.get_origin(ann) is list else (None,)
        if isinstance(item, type) and issubclass(item, BaseModel):  # data.sources: list the entry
            rows.append((dotted, f"list[{item.__name__}]", "[]", field.description or ""))
            rows.extend(schema_rows(item, prefix=f"{dotted}[]."))
            continue
        shown = yaml.safe_dump(default, default_flow_style=True) if not field.is_required() else ""
        rows.append(
            (
                dotted,
                _type_name(ann),
                shown.strip().removesuffix("\n...").removesuffix("...") or "(required)",
                field.description or "",
            )
        )
    return rows


def _type_name(ann: Any) -> str:
    args = typing.get_args(ann)
    if any(typing.get_origin(a) is typing.Annotated for a in args):  # e.g. PositiveInt | "auto"
        return " | ".join(
            _type_name(typing.get_args(a)[0] if typing.get_origin(a) is typing.Annotated else a)
            for a in args
        )
    text = repr(ann) if not isinstance(ann, type) else ann.__name__
    return text.replace("typing.", "").replace("NoneType", "None")
