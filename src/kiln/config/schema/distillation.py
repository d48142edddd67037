"""The config schema: teacher to student post-training."""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import Field

from kiln.config.schema.base import DEFAULT_MAX_KD_SCALE, Section
from kiln.util.storage import local_or_url


class DistillationConfig(Section):
    """Teacher -> student post-training."""

    teacher_run_dir: str | None = Field(
        None,
        description="kiln run directory of the teacher (its config.yaml and latest checkpoint); a URL (gs://, s3://, ...) is mirrored into {train.output_dir}/.cache/remote-runs/ first.",
    )
    teacher_logits_dir: str | None = Field(
        None,
        description="A directory written by `kiln teacher-logits`: kiln distill reads the teacher's stored top-k logits instead of running the teacher (no teacher parameters in memory).",
    )
    top_k_renormalize: bool = Field(
        False,
        description="With teacher_logits_dir: the soft loss is the plain KL of the teacher's and the student's distributions renormalised over the stored top-k ids, instead of the top-k plus one bucket for the tail mass (docs/distillation.md).",
    )
    alpha: float = Field(
        0.5,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="Weight of the distillation term, in [0, 1].",
    )
    temperature: float = Field(
        1.0,
        gt=0,
        allow_inf_nan=False,
        description="Softmax temperature T of the soft loss (> 0); the soft loss is scaled by T^2.",
    )
    beta: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="Weight of the feature loss (>= 0): beta * feature with balance=none, beta * (soft/feature) * feature inside kd with balance=dynamic; 0 switches it off.",
    )
    balance: Literal["none", "dynamic"] = Field(
        "none",
        description="none: (1-alpha) hard + alpha soft + beta feature; dynamic: magnitudes balanced against the hard loss.",
    )
    max_kd_scale: float = Field(
        DEFAULT_MAX_KD_SCALE,
        gt=0,
        allow_inf_nan=False,
        description="balance=dynamic: cap of kd_mag_scale = hard / kd (> 0), so a student near its teacher (kd -> 0) does not get its distillation gradient amplified without bound; 100 leaves balancing untouched while kd >= hard / 100.",
    )
    layer_map: list[tuple[int, int]] = Field(
        default_factory=list,
        description="[student_layer, teacher_layer] pairs whose hidden states the feature loss compares.",
    )
    feature_loss: Literal["cosine", "mse"] = Field(
        "cosine", description="Distance of the feature loss."
    )
    schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="How alpha, temperature and beta move to their *_end values over train.steps: constant (no change), linear or cosine.",
    )
    alpha_end: float | None = Field(
        None,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="alpha at the last step with schedule linear/cosine; null = alpha.",
    )
    temperature_end: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="temperature at the last step with schedule linear/cosine; null = temperature.",
    )
    beta_end: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        description="beta at the last step with schedule linear/cosine; null = beta.",
    )

    @pydantic.field_validator("teacher_run_dir")
    @classmethod
    def _teacher(cls, value: str | None) -> str | None:
        return local_or_url(value)

    @pydantic.field_validator("layer_map")
    @classmethod
    def _layers_not_negative(cls, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        for pair in pairs:
            if min(pair) < 0:
                raise ValueError(
                    f"layer {min(pair)} in {list(pair)} is negative; allowed: "
                    "[student_layer, teacher_layer] with 0 <= layer < that model's num_layers"
                )
        return pairs
