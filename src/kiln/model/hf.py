"""What every family's Hugging Face format shares: tensors as reshapes and transposes, the
config.json fields of a pre-norm decoder, RoPE settings, and the errors of import and export.

A family says what is its own in an `HFFormat` (its model types, its config.json fields, its
tensor names per layer), attached to its entry in `kiln.model.FAMILIES`; `kiln.model.interop`
dispatches on it. Conversion is a reshape and a transpose, so values are copied bit for bit.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import numpy as np

from kiln.errors import KilnError

# Buffers some older checkpoints store next to the weights; recomputed by every loader.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# The tensors outside the layers (HF name, kiln path, leading kiln dims that are HF's input).
TOP_TENSORS = (
    ("model.embed_tokens.weight", ("embedding",), None),
    ("model.norm.weight", ("final_norm", "scale"), None),
    ("lm_head.weight", ("lm_head",), 1),
)
# The index of a layer, and of an expert, in the tensor names of every family's format.
LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")
EXPERT_INDEX = re.compile(r"model\.layers\.\d+\.(?:.+\.)?experts\.(\d+)\.")


class Tensor(NamedTuple):
    """One HF tensor: kiln's array at `path`, indexed by `index` (layer in its stack, expert);
    `n_in`: how many leading kiln dims are HF's input dims (None: same layout; 0: HF's is
    kiln's flattened, a projection's bias); `order`: kiln's last axis is HF's (reshaped to
    kiln's shape) taken in this order, or None for the same order (a rotary layout that
    differs); `part` (j, n): kiln's array is columns j, j + n, ... of HF's last axis, which
    interleaves n arrays (GPT-OSS's gate and up projections), None: all of it."""

    name: str
    path: tuple[str, ...]
    index: tuple[int, ...]
    n_in: int | None
    order: tuple[int, ...] | None = None
    part: tuple[int, int] | None = None


class HFFormat:
    """A family's Hugging Face format; the defaults are those of a Llama-shaped decoder.

    `architectures`: the model types it reads and writes, with their architecture class.
    """

    architectures: ClassVar[Mapping[str, str]] = {}

    def model_type(self, m) -> str:
        """The Hugging Face model_type a kiln model of this family exports as."""
        raise NotImplementedError

    def check_exportable(self, m, kind: str) -> None:
        """KilnError naming the field when Hugging Face's `kind` cannot hold the model."""
        self.check_no_softcap(m, kind)
        arch = self.architectures[kind]
        for field, value, allowed in (
            ("model.sliding_window", m.sliding_window, "model.sliding_window=null"),
            ("model.attention_sinks", m.attention_sinks or None, "model.attention_sinks=false"),
        ):
            if value is not None:
                raise export_error(
                    field, value, f"Hugging Face {arch} attends to every earlier token", allowed
                )

    def check_no_softcap(self, m, kind: str, why: str | None = None) -> None:
        """KilnError when the model caps its logits, which `kind` does not (`why`: the
        family's own words for it)."""
        if m.logit_softcap is not None:
            raise export_error(
                "model.logit_softcap",
                m.logit_softcap,
                why or f"Hugging Face {self.architectures[kind]} has no logit soft-capping",
                "model.logit_softcap=null",
            )

    def export_notes(self, m) -> list[str]:
        """What an export leaves behind that changes no inference result."""
        return []

    def config_fields(self, m, kind: str) -> dict[str, Any]:
        """The fields of config.json that only `kind` has."""
        return {}

    def expert_count_field(self, hf: Mapping[str, Any], kind: str) -> str | None:
        """The config.json field that counts a layer's routed experts when `kind` stores each
        expert's tensors under names of their own (`EXPERT_INDEX`); None when it has none."""
        return None

    def check_import(self, hf: Mapping[str, Any], path: Path, kind: str) -> None:
        """KilnError naming a config.json field whose value the family cannot hold, checked
        before the fields every family reads (`common_section`)."""

    def common_view(self, hf: Mapping[str, Any], path: Path) -> Mapping[str, Any]:
        """The config.json that `common_section` reads: the file, less what the family reads
        its own way (`section`)."""
        return hf

    def section(
        self, hf: Mapping[str, Any], path: Path, kind: str, names: Collection[str]
    ) -> dict[str, Any]:
        """The family's fields of kiln's `model` section (with `family`) from a config.json
        and the `names` of the tensors the checkpoint holds."""
        return {}

    def layer_tensors(self, m, kind: str, layer: int) -> list[Tensor]:
        """The tensors of one layer, in order."""
        raise NotImplementedError

    def extra_tensors(self, m, kind: str) -> list[Tensor]:
        """Tensors after the layers (none by default)."""
        return []

    def copies(self, m, kind: str) -> list[Tensor]:
        """Tensors the format stores twice: written as copies of kiln's array at `path` on
        export, and on import checked equal to the tensor that array came from."""
        return []

    def describe(self, m) -> str:
        """What `kiln import-hf` says of the family's shape after the layer count ("" if none)."""
        return ""


def export_error(field: str, value, why: str, allowed: str) -> KilnError:
    return KilnError(f"{field}: {value}, but {why}; only models with {allowed} can be exported")


def require(hf: Mapping[str, Any], key: str, path: Path):
    if key not in hf:
        raise KilnError(
            f"{path}: field {key!r} is missing; a {hf['model_type']} config.json must set it"
        )
    return hf[key]


def unsupported(path: Path, field: str, value, allowed: str) -> KilnError:
    return KilnError(f"{path}: {field} is {value!r}; kiln imports only {allowed}")


def check_held(
    hf: Mapping[str, Any],
    path: Path,
    names: Collection[str],
    field: str,
    index: re.Pattern,
    what: str,
    bound: int,
) -> None:
    """KilnError unless config.json's `field`, when given, is an integer from 1 to `bound` and
    at most the number of `what` the weights hold: the distinct indices `index` finds in the
    tensor `names`. Checked before anything is listed per layer or per expert."""
    value = hf.get(field)
    if value is None:
        return  # a missing field is named where the family reads it
    if type(value) is not int or not 1 <= value <= bound:
        raise unsupported(path, field, value, f"an integer from 1 to {bound}")
    held = len({m[1] for m in map(index.match, names) if m})
    if value > held:
        raise KilnError(
            f"{path}: {field} is {value}, but the weights hold {held} {what}; allowed: at most "
            f"{held} (config.json must describe the weights beside it)"
        )


def common_config(m, kind: str, architecture: str) -> dict[str, Any]:
    """config.json fields every decoder family writes, around the family's own (`fields`)."""
    scaling = None if m.rope_scaling is None else m.rope_scaling.hf_fields()
    return {
        "architectures": [architecture],
        "model_type": kind,
        "hidden_size": m.d_model,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.resolved_head_dim,
        "vocab_size": m.vocab_size,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        # transformers < 5 reads rope_scaling, transformers >= 5 rope_parameters.
        "rope_scaling": scaling,
        "rope_parameters": {"rope_type": "default", **(scaling or {}), "rope_theta": m.rope_theta},
        "tie_word_embeddings": m.tie_embeddings,
        "max_position_embeddings": m.max_seq_len,
        "torch_dtype": m.param_dtype,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": m.init_std,
    }


def common_section(hf: Mapping[str, Any], path: Path, param_dtype: str) -> dict[str, Any]:
    """kiln's `model` fields that every decoder config.json gives the same way."""
    if hf.get("hidden_act", "silu") != "silu":
        raise unsupported(path, "hidden_act", hf["hidden_act"], "'silu' (SwiGLU)")
    for field in ("attention_bias", "mlp_bias"):
        if hf.get(field, False):
            raise unsupported(
                path, field, hf[field], "false (of the families, only gpt_oss holds biases)"
            )
    theta, scaling = rope(hf, path)
    heads = require(hf, "num_attention_heads", path)
    d_model = require(hf, "hidden_size", path)
    return {
        "vocab_size": require(hf, "vocab_size", path),
        "d_model": d_model,
        "num_layers": require(hf, "num_hidden_layers", path),
        "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or d_model // heads,
        "d_ff": require(hf, "intermediate_size", path),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "dtype": param_dtype,
        "param_dtype": param_dtype,
        "max_seq_len": hf.get("max_position_embeddings", 2048),
        "rope_theta": float(theta),
        "rope_scaling": scaling,
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "init_std": float(hf.get("initializer_range", 0.02)),
    }


LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
ROPE_ALLOWED = (
    "rope_type 'default' (rope_theta only), 'linear' (rope_theta, factor) or 'llama3' "
    "(rope_theta, " + ", ".join(LLAMA3_KEYS) + ")"
)


def rope(hf: Mapping[str, Any], path: Path) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, kiln's model.rope_scaling) as transformers reads them: the legacy rope_scaling
    takes precedence over rope_parameters, and rope_theta outside them is the fallback."""
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    found = dict(hf.get(field) or {})
    theta = found.pop("rope_theta", hf.get("rope_theta", 10000.0))
    kind = found.pop("rope_type", found.pop("type", "default"))
    if kind == "default" and not found:
        return theta, None
    if kind == "linear" and set(found) == {"factor"}:
        return theta, {"rope_type": "linear", "factor": found["factor"]}
    if kind != "llama3":
        raise unsupported(path, field, hf[field], ROPE_ALLOWED)
    # As transformers: without original_max_position_embeddings, max_position_embeddings.
    found.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    if set(found) != set(LLAMA3_KEYS) or None in found.values():
        raise unsupported(path, field, hf[field], ROPE_ALLOWED)
    return theta, {"rope_type": "llama3", **found}


# ---------------------------------------------------------------------------------------------
# Tensors: kiln's parameters <-> a Hugging Face state dict


def hf_shape(kiln_shape: tuple[int, ...], n_in: int | None) -> tuple[int, ...]:
    if n_in is None:
        return kiln_shape
    if n_in == 0:
        return (math.prod(kiln_shape),)
    return (math.prod(kiln_shape[n_in:]), math.prod(kiln_shape[:n_in]))


def to_hf(x: np.ndarray, n_in: int | None, order: tuple[int, ...] | None = None) -> np.ndarray:
    if order is not None:
        x = x[..., np.argsort(order)]
    if n_in is None:
        return np.ascontiguousarray(x)
    if n_in == 0:
        return np.ascontiguousarray(x.reshape(-1))
    return np.ascontiguousarray(x.reshape(math.prod(x.shape[:n_in]), -1).T)


def from_hf(
    w: np.ndarray,
    kiln_shape: tuple[int, ...],
    n_in: int | None,
    order: tuple[int, ...] | None = None,
) -> np.ndarray:
    if n_in is not None:
        w = w.reshape(kiln_shape) if n_in == 0 else w.T.reshape(kiln_shape)
    return np.ascontiguousarray(w if order is None else w[..., list(order)])


def get(tree: Mapping[str, Any], path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def put(tree: dict[str, Any], path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


__all__ = [
    "EXPERT_INDEX",
    "IGNORED_SUFFIXES",
    "LAYER_INDEX",
    "TOP_TENSORS",
    "HFFormat",
    "Tensor",
    "check_held",
    "common_config",
    "common_section",
    "export_error",
    "require",
    "unsupported",
]
