"""Hugging Face config.json and state dicts <-> kiln models, through each family's `HFFormat`
(`kiln.model.FAMILIES`): the commands name no family.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from kiln.config import INT32_MAX, MAX_EXPERTS
from kiln.errors import KilnError
from kiln.model import FAMILIES, Family, abstract_state
from kiln.model.hf import (
    EXPERT_INDEX,
    IGNORED_SUFFIXES,
    LAYER_INDEX,
    TOP_TENSORS,
    Tensor,
    check_held,
    common_config,
    common_section,
    from_hf,
    get,
    hf_shape,
    put,
    to_hf,
    unsupported,
)


def architectures() -> dict[str, str]:
    """Every model_type kiln reads and writes, with its architecture class, family by family."""
    return {k: v for family in FAMILIES.values() for k, v in family.hf.architectures.items()}


def _family_of(kind: str) -> Family:
    return next(f for f in FAMILIES.values() if kind in f.hf.architectures)


def model_type(model_cfg) -> str:
    """The Hugging Face model_type a kiln model exports as."""
    return FAMILIES[model_cfg.family].hf.model_type(model_cfg)


def hf_config(model_cfg, bos_id: int | None, eos_id: int | None) -> dict[str, Any]:
    """config.json of the Hugging Face model equal to kiln's (`model_type`); KilnError if HF
    cannot hold it."""
    fmt = FAMILIES[model_cfg.family].hf
    kind = fmt.model_type(model_cfg)
    fmt.check_exportable(model_cfg, kind)
    common = common_config(model_cfg, kind, fmt.architectures[kind])
    head = {k: common.pop(k) for k in ("architectures", "model_type")}
    own = fmt.config_fields(model_cfg, kind)  # a family's value of a shared field wins
    return {
        **head,
        **own,
        **{k: v for k, v in common.items() if k not in own},
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "use_cache": True,
    }


def export_notes(model_cfg) -> list[str]:
    """What an export leaves behind that changes no inference result."""
    return FAMILIES[model_cfg.family].hf.export_notes(model_cfg)


def model_section(
    hf: Mapping[str, Any], path: Path, param_dtype: str, names: Collection[str]
) -> dict[str, Any]:
    """kiln's `model` section from a config.json of a model_type some family reads and the
    `names` of the tensors beside it; KilnError naming what kiln cannot hold. The counts of
    layers and experts are checked against the names first, with the schema's bounds."""
    known = architectures()
    kind = hf.get("model_type")
    if kind not in known:
        raise unsupported(path, "model_type", kind, "'" + "', '".join(known) + "'")
    arch = hf.get("architectures") or [known[kind]]
    if arch != [known[kind]]:
        raise unsupported(path, "architectures", arch, f"[{known[kind]!r}]")
    fmt = _family_of(kind).hf
    check_held(hf, path, names, "num_hidden_layers", LAYER_INDEX, "layers", INT32_MAX)
    experts = fmt.expert_count_field(hf, kind)
    if experts is not None:
        check_held(hf, path, names, experts, EXPERT_INDEX, "experts", MAX_EXPERTS)
    fmt.check_import(hf, path, kind)
    section = common_section(fmt.common_view(hf, path), path, param_dtype)
    return {**section, **fmt.section(hf, path, kind, names)}


def describe(model_cfg) -> str:
    """The family's shape as `kiln import-hf` reports it after the layer count."""
    return FAMILIES[model_cfg.family].hf.describe(model_cfg)


def _tensors(model_cfg) -> Iterator[Tensor]:
    """Every tensor of the model, in order: for each kiln array, its items in index order."""
    m = model_cfg
    fmt = FAMILIES[m.family].hf
    kind = fmt.model_type(m)
    for name, path, n_in in TOP_TENSORS:
        if not (path == ("lm_head",) and m.tie_embeddings):
            yield Tensor(name, path, (), n_in)
    for i in range(m.num_layers):
        yield from fmt.layer_tensors(m, kind, i)
    yield from fmt.extra_tensors(m, kind)


def _copies(model_cfg) -> list[Tensor]:
    fmt = FAMILIES[model_cfg.family].hf
    return fmt.copies(model_cfg, fmt.model_type(model_cfg))


def kiln_to_hf(model_cfg, params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """HF state dict (numpy) from kiln's pure parameter dict (stacked blocks)."""
    out: dict[str, np.ndarray] = {}
    for t in chain(_tensors(model_cfg), _copies(model_cfg)):
        x = to_hf(np.asarray(get(params, t.path))[t.index], t.n_in, t.order)
        if t.part is None:
            out[t.name] = x
        else:  # one of the arrays whose columns HF interleaves
            j, n = t.part
            whole = out.setdefault(t.name, np.empty((*x.shape[:-1], n * x.shape[-1]), x.dtype))
            whole[..., j::n] = x
    return out


def hf_to_kiln(model_cfg, tensors: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """kiln's pure parameter dict from an HF state dict; KilnError naming a bad tensor."""
    shapes = _shapes(nnx.to_pure_dict(abstract_state(model_cfg)))
    expected = _expected(model_cfg, tensors, shapes)
    copies = _copies(model_cfg)
    names = {t.name for t in expected + copies}
    if model_cfg.tie_embeddings:
        names.add("lm_head.weight")  # stored by some tied checkpoints; HF ignores it too
    unexpected = sorted(n for n in tensors if n not in names and not n.endswith(IGNORED_SUFFIXES))
    if unexpected:
        raise KilnError(
            f"unexpected tensor {unexpected[0]!r} ({len(unexpected)} in all); the "
            f"{architectures()[model_type(model_cfg)]} config.json describes has no such tensor "
            "(of the families, only gpt_oss holds biases)"
        )
    items: dict[tuple[str, ...], list[np.ndarray]] = {}
    for t in expected:
        if t.name not in tensors:
            raise _missing(shapes, t)
        shape, want = get(shapes, t.path)[len(t.index) :], _hf_shape(shapes, t)
        w = tensors[t.name]
        if tuple(w.shape) != want:
            raise KilnError(
                f"tensor {t.name!r} has shape {list(w.shape)}, but config.json implies {list(want)}"
            )
        if t.part is not None:
            w = w[..., t.part[0] :: t.part[1]]
        items.setdefault(t.path, []).append(from_hf(w, shape, t.n_in, t.order))
    sources = {(t.path, t.index): t.name for t in expected}
    for t in copies:
        source = sources[(t.path, t.index)]
        if t.name in tensors and not np.array_equal(tensors[t.name], tensors[source]):
            raise KilnError(
                f"tensor {t.name!r} differs from {source!r}; kiln shares one array for both "
                "(the format stores it twice)"
            )
    out: dict[str, Any] = {}
    for path, arrays in items.items():
        # One array per index, in index order: stacked, they are kiln's array.
        put(out, path, np.stack(arrays).reshape(get(shapes, path)))
    return out


def _expected(model_cfg, tensors: Mapping[str, Any], shapes) -> list[Tensor]:
    """`_tensors(model_cfg)`; KilnError naming a missing one as soon as more names are listed
    than `tensors` holds, so that the list stays as long as the checkpoint, whatever number of
    layers and experts the config names."""
    out: list[Tensor] = []
    names: set[str] = set()
    for t in _tensors(model_cfg):
        out.append(t)
        names.add(t.name)
        if len(names) > len(tensors):  # so one of them is not there
            raise _missing(shapes, next(u for u in out if u.name not in tensors))
    return out


def _hf_shape(shapes, t: Tensor) -> tuple[int, ...]:
    """The shape of HF's tensor `t` for kiln's arrays of `shapes`."""
    want = hf_shape(get(shapes, t.path)[len(t.index) :], t.n_in)
    return want if t.part is None else (*want[:-1], t.part[1] * want[-1])


def _missing(shapes, t: Tensor) -> KilnError:
    return KilnError(f"missing tensor {t.name!r} (expected shape {list(_hf_shape(shapes, t))})")


def _shapes(tree):
    if isinstance(tree, Mapping):
        return {k: _shapes(v) for k, v in tree.items()}
    return tuple(tree.shape)
