"""The config schema: where the tokens come from (one source, or a weighted mixture)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Literal

import pydantic
from pydantic import Field

from kiln.config.schema.base import INT32_MAX, Section, Seed
from kiln.util.storage import check_url, local_dir

# Source names end up in metric tags (eval/loss/<name>) and directory-safe keys.
SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# Smallest nonzero weight of a mixture, relative to the largest: grain scales the weights so
# that the smallest becomes 100 and rounds them to integers, which overflows a float for
# ratios past ~1e306; far below that, a source would get one window in billions.
MIN_WEIGHT_RATIO = 1e-9


class SourceFields(Section):
    """What one source reads: kind, inputs, held-out split. `data` itself holds one source
    (the single-source shorthand), and every entry of `data.sources` holds one."""

    source: Literal["synthetic", "text", "jsonl", "parquet", "tokens", "none"] = Field(
        "synthetic",
        description="synthetic (generated tokens), text/jsonl/parquet (raw files, tokenized into a cache on first use), tokens (shards from `kiln prepare`) or none (no training data yet, as `kiln import-hf` writes it: `kiln train` refuses until a source is set).",
    )
    synthetic_kind: Literal["uniform", "markov"] = Field(
        "markov",
        description="For source=synthetic: uniform random tokens, or a fixed random Markov chain whose entropy is known (learnable).",
    )
    paths: list[str] = Field(
        default_factory=list,
        description="Input files, directories or globs (one string is a list of one); 'stdlib:GLOB' globs the running Python's standard library (site-packages excluded), e.g. 'stdlib:**/*.py'; 'kiln:GLOB' the data files shipped with kiln (e.g. 'kiln:stdlib_chat.jsonl', the chat set of configs/sft_tiny.yaml). For source=tokens: `kiln prepare` output directories. Each may be a URL fsspec reads (gs://, s3://, hf://, file://, memory://; see docs/data.md for the packages each needs).",
    )
    eval_paths: list[str] = Field(
        default_factory=list,
        description="A held-out set of its own, given like paths (files, directories, globs; for source=tokens prepared directories): every document of paths then trains and eval_fraction is not used. Empty = hold out eval_fraction of paths.",
    )
    field: str = Field("text", description="JSONL/Parquet field holding the document text.")
    format: Literal["text", "chat", "prompt_completion"] = Field(
        "text",
        description="What a JSONL record is: text (data.field is the document; every token is a target), chat (`messages: [{role, content}]` rendered with the chat template; only assistant turns, with their end-of-turn token, get loss weight 1) or prompt_completion (`prompt` and `completion` strings; only the completion and the EOS after it get weight 1). chat and prompt_completion need source jsonl.",
    )
    chat_template: str | None = Field(
        None,
        description="For format=chat: a Jinja chat template (Hugging Face conventions: `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`). null = the `chat_template` of the tokenizer_config.json next to data.tokenizer, or kiln's built-in template for the byte tokenizer.",
    )
    on_decode_error: Literal["error", "skip", "replace"] = Field(
        "error",
        description="A text file (or JSONL line) that is not UTF-8, with a tokenizer file: error (stop and name it), skip (leave it out), replace (invalid bytes become U+FFFD). Skipped and replaced counts are printed. The byte tokenizer reads any file as bytes and never decodes.",
    )
    eval_fraction: float = Field(
        0.01,
        ge=0,
        lt=1,
        allow_inf_nan=False,
        description="Fraction of documents held out for evaluation.",
    )

    @pydantic.field_validator("paths", "eval_paths", mode="before")
    @classmethod
    def _one_path_is_a_list(cls, value):
        # `data.paths=/dir` on the command line: one path, not a list of characters.
        return [value] if isinstance(value, str) else value

    @pydantic.field_validator("paths", "eval_paths")
    @classmethod
    def _urls_well_formed(cls, paths: list[str]) -> list[str]:
        for path in paths:
            try:
                check_url(path)
            except ValueError as e:
                raise ValueError(f"{path!r}: {e}") from None
        return paths


class SourceConfig(SourceFields):
    """One source of a mixture: the fields of a single source, a name and a weight."""

    name: str = Field(
        description="Names the source in logs and metrics (eval/loss/<name>): letters, digits, "
        "'_', '.', '-', at most 64, unique in data.sources.",
    )
    weight: float = Field(
        ge=0,
        allow_inf_nan=False,
        description="Share of training sequences drawn from this source: weight / (sum of the "
        "weights). 0 = evaluated (eval/loss/<name>) but never trained on.",
    )

    @pydantic.field_validator("weight", mode="before")
    @classmethod
    def _not_a_bool(cls, value):
        # pydantic reads true as 1.0; a numeric string stays valid (PyYAML reads 1e-3 as one).
        if isinstance(value, bool):
            raise ValueError("allowed: a number >= 0 (e.g. 0.5)")
        return value


# The fields of SourceFields that data.sources replaces; set beside it, they would be ignored.
PER_SOURCE = tuple(SourceFields.model_fields)


class DataConfig(SourceFields):
    """Where tokens come from and how they are cut into sequences."""

    sources: list[SourceConfig] = Field(
        default_factory=list,
        description="A weighted mixture: each entry is one source with its own fields (source, "
        "paths, eval_paths, field, ...) plus name and weight. Empty = the single source given by "
        "data.source, data.paths, ... With entries, those single-source fields are not set in the "
        "same file or override; set by a base_config or an earlier override, they are replaced.",
    )
    tokenizer: str = Field(
        "byte",
        description="'byte' (built-in byte-level), or a local path to a tokenizer.json or sentencepiece .model file. For source=tokens, when not given, the tokenizer named in the shards' manifest.json.",
    )
    seq_len: int = Field(256, gt=1, le=INT32_MAX, description="Tokens per training sequence.")
    seed: Seed = Field(
        0,
        description="Seed of shuffling and of synthetic data; 0 <= seed < 2^32.",
    )
    verify_shards: bool = Field(
        True,
        description="At start-up, check every token shard against the CRC-32 kiln prepare "
        "recorded (reads the whole corpus once; false: sizes and recorded maximum id only).",
    )
    cache_dir: str | None = Field(
        None,
        description="Where raw sources are tokenized to (a local path or file:// URL); null = {train.output_dir}/.cache (under train.mirror_dir when output_dir is a URL).",
    )
    prefetch_batches: int = Field(
        4,
        ge=1,
        le=64,
        description="Batches each process prepares ahead of the trainer, on background threads.",
    )

    @pydantic.field_validator("cache_dir")
    @classmethod
    def _local_cache(cls, value: str | None) -> str | None:
        return local_dir(value, "data.cache_dir")

    def mixture(self) -> list[tuple[str, SourceFields]]:
        """(field prefix for messages, source) of every source: data itself when single."""
        if not self.sources:
            return [("data", self)]
        return [(f"data.sources.{i}", s) for i, s in enumerate(self.sources)]

    def errors(self) -> Iterator[str]:
        """The rules between data's fields, one line each."""
        for prefix, s in self.mixture():
            if s.eval_paths and s.source == "synthetic":
                yield (
                    f"{prefix}.eval_paths: {s.eval_paths} given, but {prefix}.source is synthetic "
                    "(its held-out stream is generated); allowed: eval_paths with text, jsonl, "
                    "parquet or tokens"
                )
            if s.format != "text" and s.source != "jsonl":
                yield (
                    f"{prefix}.format: {s.format!r} reads JSONL records, but {prefix}.source is "
                    f"{s.source!r}; allowed: source jsonl (shards of source=tokens carry the "
                    "loss weights that kiln prepare --record-format stored)"
                )
            if s.chat_template is not None and s.format != "chat":
                yield (
                    f"{prefix}.chat_template: given, but {prefix}.format is {s.format!r}; "
                    "allowed: a template with format chat, or null"
                )
        if not self.sources:
            return
        # Set to other than its default (a resolved config.yaml lists every field, defaults too).
        both = [
            f
            for f in PER_SOURCE
            if getattr(self, f) != DataConfig.model_fields[f].get_default(call_default_factory=True)
        ]
        if both:
            yield (
                f"data.{both[0]}: set together with data.sources; allowed: either the single-"
                f"source fields ({', '.join(PER_SOURCE)}) or data.sources, whose entries each "
                "give their own"
            )
        seen: dict[str, int] = {}
        for i, s in enumerate(self.sources):
            if not SOURCE_NAME.fullmatch(s.name):
                yield (
                    f"data.sources.{i}.name: {s.name!r}; allowed: 1 to 64 letters, digits, '_', "
                    "'.', '-', starting with a letter or digit"
                )
            elif s.name in seen:
                yield (
                    f"data.sources.{i}.name: {s.name!r} is also the name of data.sources."
                    f"{seen[s.name]}; allowed: a name no other source has"
                )
            seen.setdefault(s.name, i)
            if s.source == "none":
                yield (
                    f"data.sources.{i}.source: 'none'; allowed: synthetic, text, jsonl, parquet, "
                    "tokens"
                )
        total = sum(s.weight for s in self.sources)  # fsum raises on overflow; this gives inf
        if not 0 < total < math.inf:
            yield (
                f"data.sources: the weights {[s.weight for s in self.sources]} sum to {total}; "
                "allowed: weights >= 0 with at least one > 0 and a finite sum"
            )
            return
        largest = max(s.weight for s in self.sources)
        for i, s in enumerate(self.sources):
            if 0 < s.weight < largest * MIN_WEIGHT_RATIO:
                yield (
                    f"data.sources.{i}.weight: {s.weight:g} is less than {MIN_WEIGHT_RATIO:g} of "
                    f"the largest weight, {largest:g}; allowed: 0 (not trained on) or at least "
                    f"{largest * MIN_WEIGHT_RATIO:g} (grain scales the weights to integers, "
                    "the smallest to 100)"
                )
