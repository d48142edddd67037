"""Tokenizers from a spec string: 'byte' (built in), a tokenizer.json or a sentencepiece .model."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from kiln.errors import KilnError, first_line

ALLOWED = "'byte', a local tokenizer.json (Hugging Face tokenizers) or a sentencepiece .model file"

# Candidate names of special tokens in tokenizer.json files, most specific first; such
# files do not say which token ends a text (that lives in tokenizer_config.json, if shipped).
_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[CLS]")
_PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]", "<|padding|>")


class Tokenizer(Protocol):
    """What the pipeline and `kiln prepare` need from a tokenizer."""

    spec: str  # the string it was loaded from
    kind: str  # byte | huggingface | sentencepiece
    sha256: str  # identity: hash of the model file (of a fixed string for 'byte')
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes 0..255, then BOS=256, EOS=257, PAD=258; needs no file."""

    spec = "byte"
    kind = "byte"
    sha256 = hashlib.sha256(b"kiln byte tokenizer v1: bytes, bos 256, eos 257, pad 258").hexdigest()
    vocab_size = 259
    bos_id = 256
    eos_id = 257
    pad_id = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        # Raw bytes are taken as they are, so any file (any encoding) round-trips exactly.
        return [
            np.frombuffer(t if isinstance(t, bytes) else t.encode("utf-8"), np.uint8) for t in texts
        ]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of `text` and each token's [start, end) in characters of `text`."""
        ids = np.frombuffer(text.encode("utf-8"), np.uint8)
        widths = np.fromiter((len(c.encode("utf-8")) for c in text), np.int64, len(text))
        char = np.repeat(np.arange(len(text), dtype=np.int64), widths)  # each byte's character
        return ids, np.stack([char, char + 1], axis=1).reshape(len(ids), 2)


class HuggingFaceTokenizer:
    """A `tokenizers` tokenizer.json; EOS/BOS/PAD found among its added special tokens."""

    kind = "huggingface"

    def __init__(self, path: Path, spec: str):
        import tokenizers

        self.spec, self.sha256 = spec, _file_sha256(path)
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:
            raise _BadFile(f"{path} is not a valid tokenizer.json ({first_line(e)})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        named = _special_names(path.parent / "tokenizer_config.json")
        eos = _pick(vocab, named.get("eos_token"), _EOS_NAMES)
        if eos is None:
            raise _BadFile(
                f"{path} has no end-of-text token; looked for "
                f"{', '.join(_EOS_NAMES)} (or eos_token in a tokenizer_config.json next to it)"
            )
        self.eos_id = eos
        bos = _pick(vocab, named.get("bos_token"), _BOS_NAMES)
        pad = _pick(vocab, named.get("pad_token"), _PAD_NAMES)
        self.bos_id = eos if bos is None else bos
        self.pad_id = eos if pad is None else pad

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        strs = [_utf8(t) for t in texts]
        out = self._tok.encode_batch_fast(strs, add_special_tokens=False)
        return [np.asarray(e.ids, np.uint32) for e in out]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of `text` and each token's [start, end) in characters of `text`."""
        e = self._tok.encode(text, add_special_tokens=False)
        return np.asarray(e.ids, np.uint32), np.asarray(e.offsets, np.int64).reshape(-1, 2)


class SentencePieceTokenizer:
    """A sentencepiece .model; its own BOS/EOS/PAD ids (PAD falls back to EOS if unset)."""

    kind = "sentencepiece"

    def __init__(self, path: Path, spec: str):
        import sentencepiece

        self.spec, self.sha256 = spec, _file_sha256(path)
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(str(path))
        except Exception as e:
            raise _BadFile(f"{path} is not a valid sentencepiece model ({first_line(e)})") from None
        self.vocab_size = int(self._sp.GetPieceSize())
        if self._sp.eos_id() < 0:
            raise _BadFile(f"{path} defines no end-of-sentence token (train it with eos_id >= 0)")
        self.eos_id = int(self._sp.eos_id())
        self.bos_id = int(self._sp.bos_id()) if self._sp.bos_id() >= 0 else self.eos_id
        self.pad_id = int(self._sp.pad_id()) if self._sp.pad_id() >= 0 else self.eos_id

    def encode(self, text: str) -> list[int]:
        return list(self._sp.EncodeAsIds(text))

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        ids = self._sp.EncodeAsIds([_utf8(t) for t in texts])
        return [np.asarray(i, np.uint32) for i in ids]

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.DecodeIds([int(i) for i in ids])


def load_tokenizer(spec: str, what: str = "data.tokenizer") -> Tokenizer:
    """The tokenizer named by `spec` ('byte' or a local file path); raises KilnError naming `what`."""
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    try:
        st = path.stat()
        resolved = path.resolve()
    except OSError:
        raise KilnError(f"{what}: file not found: {spec!r}; allowed: {ALLOWED}") from None
    if path.is_dir():
        raise KilnError(f"{what}: {spec!r} is a directory; allowed: {ALLOWED}")
    if path.suffix not in (".json", ".model"):
        raise KilnError(f"{what}: got {spec!r}; allowed: {ALLOWED}")
    try:
        # The file itself is the key (device, inode, size, mtime): a rewritten or replaced
        # file is loaded again, and a relative spec means a different file in another cwd.
        return _load_file(spec, resolved, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    except _BadFile as e:
        raise KilnError(f"{what}: {e}") from None


def identity(tok: Tokenizer) -> dict[str, Any]:
    """JSON description of a tokenizer, as written in manifests and compared on load."""
    return {
        "kind": tok.kind,
        "spec": tok.spec,
        "sha256": tok.sha256,
        "vocab_size": tok.vocab_size,
        "bos_id": tok.bos_id,
        "eos_id": tok.eos_id,
        "pad_id": tok.pad_id,
    }


class _BadFile(Exception):
    """A tokenizer file kiln cannot use; `load_tokenizer` names the setting it came from."""


@functools.lru_cache(maxsize=8)
def _load_file(spec: str, path: Path, *file_identity: int) -> Tokenizer:
    del file_identity  # part of the cache key only
    if path.suffix == ".json":
        return HuggingFaceTokenizer(path, spec)
    return SentencePieceTokenizer(path, spec)


def _file_sha256(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as e:
        raise _BadFile(f"cannot read {path}: {e.strerror}") from None


def _special_names(config_path: Path) -> dict[str, str]:
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return {}
    out = {}
    for key in ("eos_token", "bos_token", "pad_token"):
        value = raw.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[key] = value
    return out


def _pick(vocab: dict[str, int], preferred: str | None, names: Sequence[str]) -> int | None:
    for name in (preferred, *names):
        if name is not None and name in vocab:
            return vocab[name]
    return None


def _utf8(t: str | bytes) -> str:
    return t.decode("utf-8") if isinstance(t, bytes) else t
