"""Hugging Face checkpoints (Llama, Qwen3, Qwen3-MoE, Mixtral) <-> kiln run directories, from
and to local files only; each family's format is its `kiln.model.hf.HFFormat`, dispatched by
`kiln.model.interop`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
from collections.abc import Mapping
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file, save_file

from kiln.config import Config, config_from_dict, read_run_config
from kiln.data.tokenizers import load_tokenizer
from kiln.errors import KilnError
from kiln.model import DTYPES, abstract_state, build_model
from kiln.model.interop import (
    describe,
    export_notes,
    hf_config,
    hf_to_kiln,
    kiln_to_hf,
    model_section,
)
from kiln.parallel.mesh import make_mesh, sharded_abstract
from kiln.runs.checkpoint import Checkpointer
from kiln.runs.restore import abstract_like, restore_params
from kiln.training.runner import checkpoint_tree
from kiln.training.train import state_from_model
from kiln.util.scratch import check_stageable, staged

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# safetensors' dtype codes kiln imports, as numpy names them.
WEIGHT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


# ---------------------------------------------------------------------------------------------
# Files


def is_input(path: Path) -> bool:
    """Whether the input file `path` exists; KilnError when it is there but is not a regular
    file or a link to one (a named pipe would block the read forever, a device might not end),
    checked before it is opened."""
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as e:
        raise KilnError(f"{path}: cannot be read ({e.strerror})") from None
    if stat.S_ISREG(mode):
        return True
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"))
    kinds += ((stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"))
    kind = next((name for test, name in kinds if test(mode)), "not a file")
    raise KilnError(f"{path}: {kind}, not a regular file; allowed: a regular file or a link to one")


def weight_files(hf_dir: Path) -> list[Path]:
    """model.safetensors, or the shards model.safetensors.index.json lists: regular files."""
    if is_input(hf_dir / INDEX):
        try:
            weight_map = json.loads((hf_dir / INDEX).read_text())["weight_map"]
            names = set(weight_map.values())
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise KilnError(f"{hf_dir / INDEX}: not a safetensors index ({e!r})") from None
        if not all(isinstance(name, str) for name in names):
            raise KilnError(f"{hf_dir / INDEX}: not a safetensors index (a file name not a string)")
        files = [hf_dir / name for name in sorted(names)]
        for path in files:
            if not is_input(path):
                raise KilnError(f"{path}: no such file, but {hf_dir / INDEX} lists it")
        return files
    if is_input(hf_dir / WEIGHTS):
        return [hf_dir / WEIGHTS]
    found = ", ".join(sorted(p.name for p in hf_dir.iterdir())[:8]) or "nothing"
    raise KilnError(
        f"{hf_dir}: no {WEIGHTS} or {INDEX} (found: {found}); kiln reads safetensors "
        "weights only (re-save with save_pretrained(..., safe_serialization=True))"
    )


def tensor_dtypes(files: list[Path]) -> dict[str, str]:
    """The name and safetensors dtype code (F32, BF16, ...) of every tensor in `files`, from
    their headers: no weight is read."""
    dtypes: dict[str, str] = {}
    for path in files:
        try:
            with safe_open(path, framework="numpy") as f:
                names = f.keys()  # a safe_open is not iterable
                dtypes.update((name, f.get_slice(name).get_dtype()) for name in names)
        except (OSError, SafetensorError) as e:
            raise KilnError(f"{path}: cannot read safetensors weights: {e}") from None
    return dtypes


def read_hf_tensors(files: list[Path]) -> dict[str, np.ndarray]:
    """Every tensor of the safetensors `files`."""
    tensors: dict[str, np.ndarray] = {}
    for path in files:
        try:
            tensors.update(load_file(path))
        except (OSError, SafetensorError) as e:
            raise KilnError(f"{path}: cannot read safetensors weights: {e}") from None
    return tensors


def _param_dtype(dtypes: Mapping[str, str]) -> str:
    """bfloat16 when every tensor is bfloat16; otherwise float32 (exact for f16 and bf16)."""
    for name, code in dtypes.items():
        if code not in WEIGHT_DTYPES:
            raise KilnError(
                f"tensor {name!r} has dtype {code}; kiln imports float32, bfloat16 or float16 "
                "weights"
            )
    return "bfloat16" if set(dtypes.values()) == {"BF16"} else "float32"


def _save_tensors(tensors: Mapping[str, np.ndarray], path: Path) -> None:
    """`save_file`, with a failed write (a full disk) as the OSError it came from."""
    try:
        save_file(dict(tensors), path, metadata={"format": "pt"})
    except SafetensorError as e:
        code = re.search(r"\(os error (\d+)\)", str(e))  # safetensors' message keeps only this
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from None


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
    check_stageable(out, "--out")  # before the run is read
    config = read_run_config(run_dir, "export-hf")
    tok, note = _load_run_tokenizer(config.data.tokenizer)
    hf = hf_config(config.model, tok and tok.bos_id, tok and tok.eos_id)
    checkpoints = run_dir / "checkpoints"
    steps = _steps(checkpoints)
    if not steps:
        raise KilnError(f"{run_dir}: no complete checkpoint in {checkpoints}")
    if step is not None and step not in steps:
        raise KilnError(f"--step: no checkpoint {step} in {checkpoints}; available: {steps}")
    # Written into a staging directory that becomes --out when complete: an error or a signal
    # leaves no partial --out, and a failed write is one line naming --out.
    with staged(out, then="export it") as staging:
        # Whole parameters on the host CPU: export runs anywhere, whatever mesh trained it.
        cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
        abstract = abstract_state(config.model)
        target = abstract_like(abstract, jax.tree.map(lambda _: cpu, abstract))
        # The newest intact checkpoint, or exactly --step: verified against its manifest.
        source = checkpoints if step is None else checkpoints / str(step)
        params, step, skipped = restore_params(
            source, target, what="export-hf", checksums=config.checkpoint.verify
        )
        tensors = kiln_to_hf(config.model, jax.device_get(nnx.to_pure_dict(params)))
        (staging / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        _save_tensors(tensors, staging / WEIGHTS)
        # safetensors creates the file owner-only (0600); give it config.json's mode (the umask's).
        (staging / WEIGHTS).chmod((staging / "config.json").stat().st_mode & 0o777)
        written = ["config.json", WEIGHTS]
        if tok is not None:
            written += _copy_tokenizer(tok, staging)
    lines = [*skipped, f"exported {run_dir} step {step} to {out}: {', '.join(written)}"]
    lines += [f"note: {n}" for n in export_notes(config.model)]
    if note is None and config.data.tokenizer == "byte":
        lines.append(
            "note: the run uses kiln's byte tokenizer (ids 0-255 = bytes, bos 256, eos 257), "
            "which has no Hugging Face tokenizer file; encode text as UTF-8 bytes"
        )
    if note is not None:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def import_hf(hf_dir: str | Path, out: str | Path) -> str:
    """`kiln import-hf`: a run directory (config.yaml, step-0 checkpoint) from a local HF model."""
    hf_dir, out = Path(hf_dir).expanduser(), Path(out).expanduser().absolute()
    check_stageable(out, "--out")  # before the model is read
    config_path = hf_dir / "config.json"
    if not is_input(config_path):
        raise KilnError(f"{hf_dir}: no config.json; give a local Hugging Face model directory")
    try:
        hf = json.loads(config_path.read_text())
    except ValueError as e:
        raise KilnError(f"{config_path}: invalid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise KilnError(
            f"{config_path}: got a JSON {type(hf).__name__}; allowed: an object of model fields"
        )
    quantized = hf.get("quantization_config")
    if quantized:
        method = quantized.get("quant_method") if isinstance(quantized, dict) else quantized
        raise KilnError(
            f"{config_path}: quantization_config is {method!r}; kiln imports only unquantized "
            "float32, bfloat16 or float16 weights (dequantize the checkpoint first)"
        )
    # Built in a staging directory that becomes --out when complete: an error or a signal
    # leaves no partial run directory, and a failed write is one line naming --out.
    with staged(out, then="import it") as staging:
        config, copied = _write_run(hf_dir, hf, config_path, out, staging)
    m = config.model
    return (
        f"imported {hf_dir} ({hf['model_type']}) to {out}: {m.num_layers} layers{describe(m)}, "
        f"d_model {m.d_model}, {m.num_heads} heads ({m.kv_heads} key/value), "
        f"vocab {m.vocab_size}, {m.param_dtype}; checkpoint step 0"
        + (f"; tokenizer {', '.join(copied)}" if copied else "; no tokenizer file found")
    )


def _write_run(
    hf_dir: Path, hf: dict, config_path: Path, out: Path, staging: Path
) -> tuple[Config, list[str]]:
    """The run directory of `import_hf` written into `staging` (renamed to `out` later): its
    config and the tokenizer files copied."""
    files = weight_files(hf_dir)
    tokenizer_files = _tokenizer_files(hf_dir)
    tokenizer = hf_dir / tokenizer_files[0] if tokenizer_files else None
    # The headers say which tensors there are: config.json is checked against them before a
    # weight is read or anything is listed per layer.
    dtypes = tensor_dtypes(files)
    model = model_section(hf, config_path, _param_dtype(dtypes), dtypes.keys())
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
    tensors = read_hf_tensors(files)
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

    for name in tokenizer_files:
        shutil.copyfile(hf_dir / name, staging / name)
    ckpt = Checkpointer(staging, config.checkpoint)
    try:
        ckpt.save(0, checkpoint_tree(train_state), {})
    finally:
        ckpt.close()
    # Written last: a directory with config.yaml is a complete run.
    (staging / "config.yaml").write_text(config.to_yaml())
    return config, tokenizer_files


def _tokenizer_files(hf_dir: Path) -> list[str]:
    """The tokenizer files an import copies: tokenizer.json or tokenizer.model first, then
    tokenizer_config.json and special_tokens_map.json when there; none without a tokenizer."""
    for name in ("tokenizer.json", "tokenizer.model"):
        if is_input(hf_dir / name):
            return [name, *(n for n in TOKENIZER_FILES[1:] if is_input(hf_dir / n))]
    return []
