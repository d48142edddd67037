"""The distillation student: a family's model plus a learned projection of its features.

Einsum letters: P layer pairs, B batch, S positions, D student width, E teacher width.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

# The projection's top-level key in the student's parameters (and checkpoints).
PROJECTION = "distill_projection"


class FeatureProjection(nnx.Module):
    """Student hidden states [P,B,S,D] -> teacher width [P,B,S,E], one learned map per pair."""

    def __init__(self, pairs: int, d_student: int, d_teacher: int, *, rngs: nnx.Rngs, dtype):
        w = jax.random.normal(rngs.params(), (pairs, d_student, d_teacher), jnp.float32)
        # Variance 1/D keeps the projected states on the scale of the student's.
        value = (w * d_student**-0.5).astype(dtype)
        self.w = nnx.Param(
            value, out_sharding=(None, "embed", None), eager_sharding=False, role="projection"
        )

    def __call__(self, feats_PBSD: jax.Array) -> jax.Array:
        return jnp.einsum("PBSD,PDE->PBSE", feats_PBSD, self.w[...].astype(feats_PBSD.dtype))


@functools.cache
def student_class(family: type) -> type:
    """`family` plus a declared `distill_projection`: the model `kiln distill` trains.

    A subclass rather than a wrapper, so that its parameters are the backbone's keys with
    `distill_projection` beside them at top level: the layout of every distillation
    checkpoint, which `kiln train checkpoint.load_params_from=<distill run>` reads as a
    plain model. Everything of `LanguageModel` is the backbone's own.
    """

    class Student(family):
        def __init__(self, cfg, *, rngs: nnx.Rngs, projection: FeatureProjection | None):
            super().__init__(cfg, rngs=rngs)
            self.distill_projection = projection

        def project(self, feats_PBSD: jax.Array) -> jax.Array:
            """Student features [P,B,S,D] at the teacher's width (as they are if equal)."""
            if self.distill_projection is None:
                return feats_PBSD
            return self.distill_projection(feats_PBSD)

    Student.__name__ = Student.__qualname__ = f"Student[{family.__name__}]"
    return Student
