"""`kiln config CONFIG --explain`: the resolved config, every value with the file, override or
schema default that set it (the last one wins: base_config first, then the file, then overrides;
a layer that sets `data.sources` replaces the single-source data fields of the layers before it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from kiln.config.loader import load_config, replaced_by_sources, schema_rows, yaml_layers

Key = tuple[str, ...]


def explain(path: str | Path, overrides: Sequence[str] = ()) -> str:
    """YAML of the resolved config with a comment on each value saying where it came from."""
    config = load_config(path, overrides)  # validates first: a bad config is refused as usual
    layers = yaml_layers(path, overrides)
    origins = [(name, set(_leaf_keys(tree))) for name, tree in layers]
    replaced = replaced_by_sources(layers)
    defaults = {name: default for name, _, default, _ in schema_rows()}
    resolved = config.model_dump(mode="json")
    rows = list(_rows(resolved, ()))
    # Comments line up after the one-line values (a long list wraps; its comment follows it).
    width = max(len(text) for text, _ in rows if "\n" not in text)
    out = []
    for text, key in rows:
        if key is None:  # a section or sub-mapping heading
            out.append(text)
            continue
        origin = next((o for o, keys in reversed(origins) if _sets(keys, key)), None)
        dotted = ".".join(key)
        if dotted in replaced:
            setter, mixture = replaced[dotted]
            note = f"default (data.sources of {mixture} replaces {dotted} of {setter})"
        elif origin is None:
            note = "default"
        elif dotted in defaults and defaults[dotted] != _flow(_get(resolved, key)):
            note = f"{origin} (default {defaults[dotted]})"
        else:
            note = origin
        out.append(f"{text:<{width}}  # {note}")
    return "\n".join(out)


def _rows(tree: Mapping[str, Any], prefix: Key, indent: str = ""):
    """(line, key) per value, (heading, None) per mapping, in the order of the config."""
    for name, value in tree.items():
        key = (*prefix, name)
        if isinstance(value, Mapping) and value:
            yield f"{indent}{name}:", None
            yield from _rows(value, key, indent + "  ")
        else:
            yield f"{indent}{name}: {_flow(value)}", key


def _leaf_keys(tree: Mapping[str, Any], prefix: Key = ()):
    """The key of every value a YAML tree sets (a mapping's own keys, not the mapping)."""
    for name, value in tree.items():
        key = (*prefix, str(name))
        if isinstance(value, Mapping) and value:
            yield from _leaf_keys(value, key)
        else:
            yield key


def _sets(keys: set[Key], key: Key) -> bool:
    """Whether a layer that set `keys` set `key`: itself, or a mapping that holds it."""
    return any(key[:n] in keys for n in range(1, len(key) + 1))


def _get(tree: Mapping[str, Any], key: Key) -> Any:
    node: Any = tree
    for part in key:
        node = node[part]
    return node


def _flow(value: Any) -> str:
    return (
        yaml.safe_dump(value, default_flow_style=True)
        .strip()
        .removesuffix("\n...")
        .removesuffix("...")
    )
