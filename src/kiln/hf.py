"""Hugging Face Llama checkpoints <-> kiln run directories, from and to local files only.

kiln's `llama` family is the Llama architecture: pre-norm RMSNorm blocks, grouped-query
attention, SwiGLU, rotary embeddings. Both use the rotate-half rotary layout (HF's
`rotate_half`, same frequencies), so q/k projections map without the head-dim permutation
that HF's conversion script applies to Meta's interleaved checkpoints; tests/test_hf.py
checks this on logits.

Layouts (kiln -> HF, where HF's Linear weight is [out, in]): wq [D,N,H] -> q_proj [N*H, D],
wk/wv [D,K,H] -> [K*H, D], wo [N,H,D] -> o_proj [D, N*H], w_gate/w_up [D,F] -> [F, D],
w_down [F,D] -> [D, F], lm_head [D,V] -> [V, D]; embedding [V,D] and norm scales as they are.
Conversion is a reshape and a transpose, so values are copied bit for bit.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from kiln.checkpoint import Checkpointer, abstract_like, restore_params
from kiln.config import config_from_dict, read_run_config
from kiln.data.tokenizers import load_tokenizer
from kiln.errors import KilnError
from kiln.mesh import make_mesh, sharded_abstract
from kiln.model import DTYPES, abstract_state, build_model
from kiln.runner import checkpoint_tree
from kiln.train import state_from_model

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# (HF name inside layer i, kiln path inside `blocks`, how many leading kiln dims are HF's input
# dims; None = a vector, same layout).
LAYER_TENSORS = (
    ("self_attn.q_proj.weight", ("attn", "wq"), 1),
    ("self_attn.k_proj.weight", ("attn", "wk"), 1),
    ("self_attn.v_proj.weight", ("attn", "wv"), 1),
    ("self_attn.o_proj.weight", ("attn", "wo"), 2),
    ("mlp.gate_proj.weight", ("mlp", "w_gate"), 1),
    ("mlp.up_proj.weight", ("mlp", "w_up"), 1),
    ("mlp.down_proj.weight", ("mlp", "w_down"), 1),
    ("input_layernorm.weight", ("attn_norm", "scale"), None),
    ("post_attention_layernorm.weight", ("mlp_norm", "scale"), None),
)
TOP_TENSORS = (
    ("model.embed_tokens.weight", ("embedding",), None),
    ("model.norm.weight", ("final_norm", "scale"), None),
    ("lm_head.weight", ("lm_head",), 1),
)
# Buffers some older checkpoints store next to the weights; recomputed by every loader.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


# ---------------------------------------------------------------------------------------------
# Tensor layouts


def _hf_shape(kiln_shape: tuple[int, ...], n_in: int | None) -> tuple[int, ...]:
    if n_in is None:
        return kiln_shape
    return (math.prod(kiln_shape[n_in:]), math.prod(kiln_shape[:n_in]))


def _to_hf(x: np.ndarray, n_in: int | None) -> np.ndarray:
    if n_in is None:
        return np.ascontiguousarray(x)
    return np.ascontiguousarray(x.reshape(math.prod(x.shape[:n_in]), -1).T)


def _from_hf(w: np.ndarray, kiln_shape: tuple[int, ...], n_in: int | None) -> np.ndarray:
    return w if n_in is None else np.ascontiguousarray(w.T.reshape(kiln_shape))


def _get(tree: Mapping[str, Any], path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict[str, Any], path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _tensor_specs(model_cfg, kiln_shapes: Mapping[str, Any]):
    """(HF name, kiln path, layer index or None, n_in, kiln shape) of every tensor of the model."""
    specs = []
    for name, path, n_in in TOP_TENSORS:
        if path == ("lm_head",) and model_cfg.tie_embeddings:
            continue
        specs.append((name, path, None, n_in, tuple(_get(kiln_shapes, path))))
    for i in range(model_cfg.num_layers):
        for name, path, n_in in LAYER_TENSORS:
            shape = tuple(_get(kiln_shapes["blocks"], path))[1:]
            specs.append((f"model.layers.{i}.{name}", ("blocks", *path), i, n_in, shape))
    return specs


def kiln_to_hf(model_cfg, params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """HF Llama state dict (numpy) from kiln's pure parameter dict (stacked blocks)."""
    shapes = _shapes(params)
    out = {}
    for name, path, layer, n_in, _ in _tensor_specs(model_cfg, shapes):
        x = np.asarray(_get(params, path))
        out[name] = _to_hf(x if layer is None else x[layer], n_in)
    return out


def hf_to_kiln(model_cfg, tensors: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """kiln's pure parameter dict from an HF Llama state dict; KilnError naming a bad tensor."""
    shapes = _shapes(nnx.to_pure_dict(abstract_state(model_cfg)))
    expected = _tensor_specs(model_cfg, shapes)
    names = {name for name, *_ in expected}
    if model_cfg.tie_embeddings:
        names.add("lm_head.weight")  # stored by some tied checkpoints; HF ignores it too
    unexpected = sorted(n for n in tensors if n not in names and not n.endswith(IGNORED_SUFFIXES))
    if unexpected:
        raise KilnError(
            f"unexpected tensor {unexpected[0]!r} ({len(unexpected)} in all); a Llama model "
            "without biases has only embed_tokens, q/k/v/o_proj, gate/up/down_proj, the norms "
            "and lm_head"
        )
    layers: dict[tuple[str, ...], list[np.ndarray]] = {}
    out: dict[str, Any] = {}
    for name, path, layer, n_in, shape in expected:
        if name not in tensors:
            raise KilnError(
                f"missing tensor {name!r} (expected shape {list(_hf_shape(shape, n_in))})"
            )
        w = tensors[name]
        if tuple(w.shape) != _hf_shape(shape, n_in):
            raise KilnError(
                f"tensor {name!r} has shape {list(w.shape)}, but config.json implies "
                f"{list(_hf_shape(shape, n_in))}"
            )
        if layer is None:
            _set(out, path, _from_hf(w, shape, n_in))
        else:
            layers.setdefault(path, []).append(_from_hf(w, shape, n_in))
    for path, per_layer in layers.items():
        _set(out, path, np.stack(per_layer))
    return out


def _shapes(tree):
    if isinstance(tree, Mapping):
        return {k: _shapes(v) for k, v in tree.items()}
    return tuple(tree.shape)


# ---------------------------------------------------------------------------------------------
# Configs


def hf_config(model_cfg, bos_id: int | None, eos_id: int | None) -> dict[str, Any]:
    """config.json of a LlamaForCausalLM equal to kiln's model; KilnError if HF cannot hold it."""
    m = model_cfg
    if m.qk_norm:
        raise KilnError(
            "model.qk_norm: true, but Hugging Face Llama has no query/key normalisation; "
            "only models trained with model.qk_norm=false can be exported"
        )
    if m.logit_softcap is not None:
        raise KilnError(
            f"model.logit_softcap: {m.logit_softcap}, but Hugging Face Llama has no logit "
            "soft-capping; only models trained with model.logit_softcap=null can be exported"
        )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": m.d_model,
        "intermediate_size": m.d_ff,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.resolved_head_dim,
        "vocab_size": m.vocab_size,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "rope_scaling": None,
        # transformers >= 5 reads the rotary settings from here.
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "tie_word_embeddings": m.tie_embeddings,
        "max_position_embeddings": m.max_seq_len,
        "torch_dtype": m.param_dtype,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": m.init_std,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "use_cache": True,
    }


def _require(hf: Mapping[str, Any], key: str, path: Path):
    if key not in hf:
        raise KilnError(f"{path}: field {key!r} is missing; a Llama config.json must set it")
    return hf[key]


def _unsupported(path: Path, field: str, value, allowed: str) -> KilnError:
    return KilnError(f"{path}: {field} is {value!r}; kiln imports only {allowed}")


def model_section(hf: Mapping[str, Any], path: Path, param_dtype: str) -> dict[str, Any]:
    """kiln's `model` section from a Llama config.json; KilnError naming what kiln cannot hold."""
    model_type = hf.get("model_type")
    if model_type != "llama":
        raise _unsupported(path, "model_type", model_type, "'llama'")
    arch = hf.get("architectures") or ["LlamaForCausalLM"]
    if arch != ["LlamaForCausalLM"]:
        raise _unsupported(path, "architectures", arch, "['LlamaForCausalLM']")
    if hf.get("hidden_act", "silu") != "silu":
        raise _unsupported(path, "hidden_act", hf["hidden_act"], "'silu' (SwiGLU)")
    for field in ("attention_bias", "mlp_bias"):
        if hf.get(field, False):
            raise _unsupported(path, field, hf[field], "false (kiln has no biases)")
    if hf.get("rope_scaling") is not None:
        raise _unsupported(path, "rope_scaling", hf["rope_scaling"], "null (plain rotary)")
    theta = hf.get("rope_theta", 10000.0)
    rope = hf.get("rope_parameters")
    if rope is not None:
        extra = sorted(set(rope) - {"rope_type", "rope_theta"})
        if rope.get("rope_type", "default") != "default" or extra:
            raise _unsupported(
                path, "rope_parameters", rope, "rope_type 'default' with rope_theta only"
            )
        theta = rope.get("rope_theta", theta)
    heads = _require(hf, "num_attention_heads", path)
    d_model = _require(hf, "hidden_size", path)
    return {
        "vocab_size": _require(hf, "vocab_size", path),
        "d_model": d_model,
        "num_layers": _require(hf, "num_hidden_layers", path),
        "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or d_model // heads,
        "d_ff": _require(hf, "intermediate_size", path),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "dtype": param_dtype,
        "param_dtype": param_dtype,
        "max_seq_len": hf.get("max_position_embeddings", 2048),
        "rope_theta": float(theta),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "init_std": float(hf.get("initializer_range", 0.02)),
    }


# ---------------------------------------------------------------------------------------------
# Files


def read_hf_tensors(hf_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of model.safetensors, or of the shards a model.safetensors.index.json lists."""
    if (hf_dir / INDEX).is_file():
        try:
            weight_map = json.loads((hf_dir / INDEX).read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise KilnError(f"{hf_dir / INDEX}: not a safetensors index ({e})") from None
        files = sorted(set(weight_map.values()))
    elif (hf_dir / WEIGHTS).is_file():
        files = [WEIGHTS]
    else:
        found = ", ".join(sorted(p.name for p in hf_dir.iterdir())[:8]) or "nothing"
        raise KilnError(
            f"{hf_dir}: no {WEIGHTS} or {INDEX} (found: {found}); kiln reads safetensors "
            "weights only (re-save with save_pretrained(..., safe_serialization=True))"
        )
    tensors: dict[str, np.ndarray] = {}
    for name in files:
        try:
            tensors.update(load_file(hf_dir / name))
        except (OSError, SafetensorError) as e:
            raise KilnError(f"{hf_dir / name}: cannot read safetensors weights: {e}") from None
    return tensors


def _param_dtype(tensors: Mapping[str, np.ndarray]) -> str:
    """bfloat16 when every tensor is bfloat16; otherwise float32 (exact for f16 and bf16)."""
    names = {np.dtype(t.dtype).name for t in tensors.values()}
    other = sorted(names - {"float32", "bfloat16", "float16"})
    if other:
        raise KilnError(f"weights of dtype {other[0]}; kiln imports float32, bfloat16 or float16")
    return "bfloat16" if names == {"bfloat16"} else "float32"


def _empty_dir(path: Path, flag: str) -> None:
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise KilnError(f"{flag}: {path} already exists and is not empty; choose a new directory")


def _steps(checkpoints: Path) -> list[int]:
    if not checkpoints.is_dir():
        return []
    return sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit() and p.is_dir())


def _tokenizer_ids(spec: str) -> tuple[int | None, int | None, str | None]:
    """(bos, eos, note) of the run's tokenizer; a missing file is a note, not an error."""
    try:
        tok = load_tokenizer(spec)
    except KilnError as e:
        return None, None, f"tokenizer not exported: {e}"
    return tok.bos_id, tok.eos_id, None


def _copy_tokenizer(spec: str, out: Path) -> list[str]:
    """Copy a local tokenizer file (and its tokenizer_config.json) in the names HF expects."""
    if spec == "byte":
        return []
    src = Path(spec).expanduser()
    if src.suffix == ".model":
        shutil.copyfile(src, out / "tokenizer.model")
        config = {"tokenizer_class": "LlamaTokenizer"}
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        return ["tokenizer.model", "tokenizer_config.json"]
    shutil.copyfile(src, out / "tokenizer.json")
    written = ["tokenizer.json"]
    for name in TOKENIZER_FILES[1:]:
        if (src.parent / name).is_file():
            shutil.copyfile(src.parent / name, out / name)
            written.append(name)
    if "tokenizer_config.json" not in written:
        config = {"tokenizer_class": "PreTrainedTokenizerFast"}
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        written.append("tokenizer_config.json")
    return written


# ---------------------------------------------------------------------------------------------
# Commands


def export_hf(run_dir: str | Path, out: str | Path, step: int | None = None) -> str:
    """`kiln export-hf`: config.json, model.safetensors and tokenizer files of a run's checkpoint."""
    run_dir, out = Path(run_dir).expanduser(), Path(out).expanduser()
    config = read_run_config(run_dir, "export-hf")
    bos, eos, note = _tokenizer_ids(config.data.tokenizer)
    hf = hf_config(config.model, bos, eos)
    checkpoints = run_dir / "checkpoints"
    steps = _steps(checkpoints)
    if not steps:
        raise KilnError(f"{run_dir}: no complete checkpoint in {checkpoints}")
    if step is not None and step not in steps:
        raise KilnError(f"--step: no checkpoint {step} in {checkpoints}; available: {steps}")
    _empty_dir(out, "--out")

    # Whole parameters on the host CPU: export runs anywhere, whatever mesh trained the model.
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    abstract = abstract_state(config.model)
    target = abstract_like(abstract, jax.tree.map(lambda _: cpu, abstract))
    # The newest intact checkpoint, or exactly --step: verified against its manifest.
    source = checkpoints if step is None else checkpoints / str(step)
    params, step, skipped = restore_params(
        source, target, what="export-hf", checksums=config.checkpoint.verify
    )
    tensors = kiln_to_hf(config.model, jax.device_get(nnx.to_pure_dict(params)))

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    save_file(tensors, out / WEIGHTS, metadata={"format": "pt"})
    written = ["config.json", WEIGHTS]
    if note is None:
        written += _copy_tokenizer(config.data.tokenizer, out)
    lines = [*skipped, f"exported {run_dir} step {step} to {out}: {', '.join(written)}"]
    if note is None and config.data.tokenizer == "byte":
        lines.append(
            "note: the run uses kiln's byte tokenizer (ids 0-255 = bytes, bos 256, eos 257), "
            "which has no Hugging Face tokenizer file; encode text as UTF-8 bytes"
        )
    if note is not None:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def import_hf(hf_dir: str | Path, out: str | Path) -> str:
    """`kiln import-hf`: a run directory (config.yaml, step-0 checkpoint) from a local HF Llama."""
    hf_dir, out = Path(hf_dir).expanduser(), Path(out).expanduser().absolute()
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise KilnError(f"{hf_dir}: no config.json; give a local Hugging Face model directory")
    try:
        hf = json.loads(config_path.read_text())
    except ValueError as e:
        raise KilnError(f"{config_path}: invalid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise KilnError(
            f"{config_path}: got a JSON {type(hf).__name__}; allowed: an object of model fields"
        )
    _empty_dir(out, "--out")
    tensors = read_hf_tensors(hf_dir)
    model = model_section(hf, config_path, _param_dtype(tensors))
    tokenizer = _tokenizer_source(hf_dir)
    raw = {
        "model": model,
        "data": {
            "seq_len": min(256, model["max_seq_len"]),
            "tokenizer": str(out / tokenizer.name) if tokenizer else "byte",
        },
        "train": {"output_dir": str(out.parent), "run_name": out.name},
    }
    try:
        config = config_from_dict(raw)
    except KilnError as e:
        raise KilnError(f"{config_path}: not a model kiln can hold: {e}") from None
    try:
        params = hf_to_kiln(config.model, tensors)
    except KilnError as e:
        raise KilnError(f"{hf_dir}: {e}") from None
    del tensors

    mesh = make_mesh(config)
    graphdef, state = sharded_abstract(
        lambda: build_model(config.model, rngs=nnx.Rngs(0)), mesh, config.mesh.rules
    )
    shardings = jax.tree.map(lambda x: x.sharding, state)
    dtype = DTYPES[config.model.param_dtype]
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda x: x.astype(dtype), params))
    state = jax.device_put(state, shardings)
    train_state = state_from_model(config, mesh, nnx.merge(graphdef, state))

    out.mkdir(parents=True, exist_ok=True)
    copied = []
    if tokenizer is not None:
        for name in (tokenizer.name, *TOKENIZER_FILES[1:]):
            if (hf_dir / name).is_file():
                shutil.copyfile(hf_dir / name, out / name)
                copied.append(name)
    ckpt = Checkpointer(out, config.checkpoint)
    try:
        ckpt.save(0, checkpoint_tree(train_state), {})
    finally:
        ckpt.close()
    # Written last: a directory with config.yaml is a complete run.
    (out / "config.yaml").write_text(config.to_yaml())
    m = config.model
    return (
        f"imported {hf_dir} to {out}: {m.num_layers} layers, d_model {m.d_model}, "
        f"{m.num_heads} heads ({m.kv_heads} key/value), vocab {m.vocab_size}, "
        f"{m.param_dtype}; checkpoint step 0"
        + (f"; tokenizer {', '.join(copied)}" if copied else "; no tokenizer file found")
    )


def _tokenizer_source(hf_dir: Path) -> Path | None:
    for name in ("tokenizer.json", "tokenizer.model"):
        if (hf_dir / name).is_file():
            return hf_dir / name
    return None
