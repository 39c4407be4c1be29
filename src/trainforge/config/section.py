"""What every config section is made of: the base class that refuses unknown keys, and the bounds
and bounded number types the sections share (``schema.py`` and ``data.py`` both build on them)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

# Upper bounds that no real run comes near; they keep a typo (1e26, an extra zero) from reaching
# torch or Ray as a size, a loop bound or an allocation. docs/configuration.md lists them.
MAX_STEPS = 10**10
MAX_EPOCHS = 10**6
MAX_BATCH = 1 << 24
MAX_WORKERS = 10_000
MAX_SAMPLES = 1 << 40
MAX_DIM = 1 << 24  # one entry of input_shape, seq_len, vocab_size, num_classes, image_size
MAX_COUNT = 10**6  # small counts: grad accumulation, keep_last, threads, loader workers, failures, trials
MAX_SECONDS = 7 * 24 * 3600.0  # a week: intervals and timeouts
MAX_STR = 4096  # characters of any string value (PATH_MAX on Linux)

PositiveInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
Steps = Annotated[int, Field(ge=1, le=MAX_STEPS)]
Count = Annotated[int, Field(ge=1, le=MAX_COUNT)]
Workers = Annotated[int, Field(ge=1, le=MAX_WORKERS)]
Dim = Annotated[int, Field(ge=1, le=MAX_DIM)]
Seconds = Annotated[float, Field(gt=0, le=MAX_SECONDS)]


class Section(BaseModel):
    """Base for every config section: unknown keys are errors, assignments are validated.

    Every float is finite (``allow_inf_nan``: .inf and .nan are refused wherever a number goes)
    and every string at most MAX_STR characters.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False, str_max_length=MAX_STR)
