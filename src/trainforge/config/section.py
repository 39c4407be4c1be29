"""What every config section is made of: the base class that refuses unknown keys, and the bounds
and bounded number types the sections share (``schema.py`` and ``data.py`` both build on them)."""

from __future__ import annotations

import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

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

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """``epochs: true`` is not 1: pydantic's lax mode takes a bool for an int or a float (in a
        list or a mapping too); a number's key refuses it here, a key that also takes a bool keeps it."""
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and bool_for_a_number(value, field.annotation):
            raise ValueError("Input should be a number, not true or false")
        return value


def bool_for_a_number(value: Any, annotation: Any) -> bool:
    """Whether ``value`` holds a bool where ``annotation`` takes a number and no bool."""
    leaves = _leaves(annotation)
    if isinstance(value, bool):
        return any(leaf in (int, float) for leaf in leaves) and not any(_takes_bool(leaf) for leaf in leaves)
    if isinstance(value, (list, tuple)):
        return any(
            bool_for_a_number(item, Union[tuple(_item_types(leaves, index))])  # noqa: UP007 (a runtime union)
            for index, item in enumerate(value)
            if _item_types(leaves, index)
        )
    if isinstance(value, dict):
        kinds = [get_args(leaf)[1] for leaf in leaves if get_origin(leaf) is dict and len(get_args(leaf)) == 2]
        return bool(kinds) and any(bool_for_a_number(item, Union[tuple(kinds)]) for item in value.values())  # noqa: UP007
    return False


def _leaves(annotation: Any) -> list[Any]:
    """The types a (possibly Annotated, possibly union) annotation is made of."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _leaves(get_args(annotation)[0])
    if origin is Union or origin is types.UnionType:
        return [leaf for member in get_args(annotation) for leaf in _leaves(member)]
    return [annotation]


def _takes_bool(leaf: Any) -> bool:
    if leaf in (bool, Any, object):
        return True
    return get_origin(leaf) is Literal and any(isinstance(choice, bool) for choice in get_args(leaf))


def _item_types(leaves: list[Any], index: int) -> list[Any]:
    """The types the ``index``-th item of a list or tuple may have under ``leaves``."""
    found = []
    for leaf in leaves:
        origin, args = get_origin(leaf), get_args(leaf)
        if (origin is list and args) or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
            found.append(args[0])
        elif origin is tuple and index < len(args):
            found.append(args[index])
    return found
