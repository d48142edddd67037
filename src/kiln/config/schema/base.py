"""What every config section shares: the base class and the integer bounds."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

# Token ids, positions and the step counter are int32 on the device; sizes and counts stay
# below its limit so they fit wherever they are used.
INT32_MAX = 2**31 - 1
PositiveInt = Annotated[int, Field(gt=0, le=INT32_MAX)]
Count = Annotated[int, Field(ge=0, le=INT32_MAX)]
# numpy refuses negative seeds, the data pipeline's shuffle takes 32 bits, and JAX's keys
# keep a seed's low 32 bits (2^32 would give seed 0's key).
SEED_LIMIT = 2**32
Seed = Annotated[int, Field(ge=0, lt=SEED_LIMIT)]
# z * logsumexp^2 in float32: PaLM and MaxText use 1e-4; with z <= 1 the term stays finite
# for any |logsumexp| below 1e19, while z = 1e38 overflows at the first step.
Z_LOSS_MAX = 1.0
# Cap of distill/kd_mag_scale = hard / kd under dynamic balancing (see DistillationConfig).
DEFAULT_MAX_KD_SCALE = 100.0


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, and a loaded config is frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
