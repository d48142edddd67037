"""Hugging Face Llama (and, with qk_norm, Qwen3) checkpoints <-> kiln run directories, from and
to local files only.

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

import contextlib
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

from kiln.commands.hf_config import hf_config, model_section
from kiln.config import config_from_dict, read_run_config
from kiln.data.tokenizers import load_tokenizer
from kiln.errors import KilnError
from kiln.model import DTYPES, abstract_state, build_model
from kiln.parallel.mesh import make_mesh, sharded_abstract
from kiln.runs.checkpoint import Checkpointer, abstract_like, restore_params
from kiln.training.runner import checkpoint_tree
from kiln.training.train import state_from_model

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
# Qwen3's per-head query/key RMSNorm weights [H], for models with model.qk_norm.
QK_NORM_TENSORS = (
    ("self_attn.q_norm.weight", ("attn", "q_norm", "scale"), None),
    ("self_attn.k_norm.weight", ("attn", "k_norm", "scale"), None),
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
        for name, path, n_in in LAYER_TENSORS + (QK_NORM_TENSORS if model_cfg.qk_norm else ()):
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
            "(q_norm/k_norm for Qwen3) and lm_head"
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


def _load_run_tokenizer(spec: str):
    """(tokenizer, note) of the run; a missing file is a note, not an error."""
    try:
        return load_tokenizer(spec), None
    except KilnError as e:
        return None, f"tokenizer not exported: {e}"


def _special_tokens(tok, path: Path) -> dict[str, str]:
    """bos/eos/pad_token strings of kiln's ids, as transformers reads them from tokenizer_config."""
    if path.suffix == ".model":
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor()
        sp.Load(str(path))
        piece = sp.IdToPiece
    else:
        import tokenizers

        piece = tokenizers.Tokenizer.from_file(str(path)).id_to_token
    ids = {"bos_token": tok.bos_id, "eos_token": tok.eos_id, "pad_token": tok.pad_id}
    return {key: piece(i) for key, i in ids.items()}


def _copy_tokenizer(tok, out: Path) -> list[str]:
    """Copy a local tokenizer file in the names HF expects; tokenizer_config.json names kiln's
    BOS/EOS/PAD so AutoTokenizer agrees with the ids in config.json."""
    if tok.kind == "byte":
        return []
    src = Path(tok.spec).expanduser()
    if src.suffix == ".model":
        shutil.copyfile(src, out / "tokenizer.model")
        written, config = ["tokenizer.model"], {"tokenizer_class": "LlamaTokenizer"}
    else:
        shutil.copyfile(src, out / "tokenizer.json")
        written, config = ["tokenizer.json"], {"tokenizer_class": "PreTrainedTokenizerFast"}
        if (src.parent / "special_tokens_map.json").is_file():
            shutil.copyfile(src.parent / "special_tokens_map.json", out / "special_tokens_map.json")
            written.append("special_tokens_map.json")
        # Without one beside the tokenizer (or an unreadable one): the minimal config above.
        with contextlib.suppress(OSError, ValueError):
            config = json.loads((src.parent / "tokenizer_config.json").read_text())
    for key, content in _special_tokens(tok, src).items():
        old = config.get(key)
        if not (isinstance(old, dict) and old.get("content") == content):
            config[key] = content  # an AddedToken dict naming the same token is kept as it is
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return [*written, "tokenizer_config.json"]


# ---------------------------------------------------------------------------------------------
# Commands


def export_hf(run_dir: str | Path, out: str | Path, step: int | None = None) -> str:
    """`kiln export-hf`: config.json, model.safetensors and tokenizer files of a run's checkpoint."""
    run_dir, out = Path(run_dir).expanduser(), Path(out).expanduser()
    config = read_run_config(run_dir, "export-hf")
    tok, note = _load_run_tokenizer(config.data.tokenizer)
    hf = hf_config(config.model, tok and tok.bos_id, tok and tok.eos_id)
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
    # safetensors creates the file owner-only (0600); give it config.json's mode (the umask's).
    (out / WEIGHTS).chmod((out / "config.json").stat().st_mode & 0o777)
    written = ["config.json", WEIGHTS]
    if tok is not None:
        written += _copy_tokenizer(tok, out)
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
            "source": "none",  # kiln train refuses it: no silent training on synthetic tokens
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
