"""The config schema: where the tokens come from."""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import Field

from kiln.schema.base import INT32_MAX, Section, Seed


class DataConfig(Section):
    """Where tokens come from and how they are cut into sequences."""

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
        description="Input files, directories or globs (one string is a list of one); 'stdlib:GLOB' globs the running Python's standard library (site-packages excluded), e.g. 'stdlib:**/*.py'; 'kiln:GLOB' the data files shipped with kiln (e.g. 'kiln:stdlib_chat.jsonl', the chat set of configs/sft_tiny.yaml). For source=tokens: `kiln prepare` output directories.",
    )
    eval_paths: list[str] = Field(
        default_factory=list,
        description="A held-out set of its own, given like data.paths (files, directories, globs; for source=tokens prepared directories): every document of data.paths then trains and data.eval_fraction is not used. Empty = hold out data.eval_fraction of data.paths.",
    )
    field: str = Field("text", description="JSONL/Parquet field holding the document text.")
    format: Literal["text", "chat", "prompt_completion"] = Field(
        "text",
        description="What a JSONL record is: text (data.field is the document; every token is a target), chat (`messages: [{role, content}]` rendered with the chat template; only assistant turns, with their end-of-turn token, get loss weight 1) or prompt_completion (`prompt` and `completion` strings; only the completion and the EOS after it get weight 1). chat and prompt_completion need data.source jsonl.",
    )
    chat_template: str | None = Field(
        None,
        description="For format=chat: a Jinja chat template (Hugging Face conventions: `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`). null = the `chat_template` of the tokenizer_config.json next to data.tokenizer, or kiln's built-in template for the byte tokenizer.",
    )
    tokenizer: str = Field(
        "byte",
        description="'byte' (built-in byte-level), or a local path to a tokenizer.json or sentencepiece .model file. For source=tokens, when not given, the tokenizer named in the shards' manifest.json.",
    )
    on_decode_error: Literal["error", "skip", "replace"] = Field(
        "error",
        description="A text file (or JSONL line) that is not UTF-8, with a tokenizer file: error (stop and name it), skip (leave it out), replace (invalid bytes become U+FFFD). Skipped and replaced counts are printed. The byte tokenizer reads any file as bytes and never decodes.",
    )
    seq_len: int = Field(256, gt=1, le=INT32_MAX, description="Tokens per training sequence.")
    seed: Seed = Field(
        0,
        description="Seed of shuffling and of synthetic data; 0 <= seed < 2^32.",
    )
    eval_fraction: float = Field(
        0.01,
        ge=0,
        lt=1,
        allow_inf_nan=False,
        description="Fraction of documents held out for evaluation.",
    )
    verify_shards: bool = Field(
        True,
        description="At start-up, check every token shard against the CRC-32 kiln prepare "
        "recorded (reads the whole corpus once; false: sizes and recorded maximum id only).",
    )
    cache_dir: str | None = Field(
        None, description="Where raw sources are tokenized to; null = {train.output_dir}/.cache."
    )
    prefetch_batches: int = Field(
        4,
        ge=1,
        le=64,
        description="Batches each process prepares ahead of the trainer, on background threads.",
    )

    @pydantic.field_validator("paths", "eval_paths", mode="before")
    @classmethod
    def _one_path_is_a_list(cls, value):
        # `data.paths=/dir` on the command line: one path, not a list of characters.
        return [value] if isinstance(value, str) else value
