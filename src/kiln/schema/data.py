"""The config schema: where the tokens come from."""

from __future__ import annotations

from typing import Literal

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
        description="Input files, directories or globs; 'stdlib:GLOB' globs the running Python's standard library (site-packages excluded), e.g. 'stdlib:**/*.py'. For source=tokens: `kiln prepare` output directories.",
    )
    field: str = Field("text", description="JSONL/Parquet field holding the document text.")
    tokenizer: str = Field(
        "byte",
        description="'byte' (built-in byte-level), or a local path to a tokenizer.json or sentencepiece .model file.",
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
