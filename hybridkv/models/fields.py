"""Typed readers of spec and config fields: one error message shape (a :class:`SpecError` naming
the file and the field) for every bad value, shared by hybridkv's spec files and the readers of
HuggingFace configs."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from hybridkv.errors import SpecError
from hybridkv.models.spec import DType

_MISSING = object()
MAX_LAYERS = 100_000  # far above any real model; a bigger count is a typo, not a model to expand


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {value}".lower()
    if isinstance(value, Mapping):
        return "a table"
    if isinstance(value, list | tuple):
        return "a list"
    return f"{type(value).__name__} {value!r}"[:80]


def _whole(value: Any, where: str, field: str, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum``: ints and integral floats; bools, strings, fractions refused."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SpecError(f"{where}: {field} must be a whole number, got {_kind(value)}")
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise SpecError(f"{where}: {field} must be a whole number, got {value!r} (not truncated)")
        value = int(value)
    if value < minimum:
        raise SpecError(f"{where}: {field} must be >= {minimum}, got {value}")
    return value


def _field(table: Mapping[str, Any], key: str, where: str, default: Any = _MISSING, minimum: int = 1) -> int:
    value = table.get(key, default)
    if value is None and default is not _MISSING:
        value = default  # HF configs write null for "use the default"
    if value is _MISSING:
        raise SpecError(f"{where}: needs {key!r}")
    return _whole(value, where, key, minimum)


def _table(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise SpecError(f"{where}: must be a table/object, got {_kind(value)}")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise SpecError(f"{where}: must be a list, got {_kind(value)}")
    return list(value)


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise SpecError(f"{where}: must be a string, got {_kind(value)}")
    return value


def _dtype(value: Any, where: str) -> DType:
    if not isinstance(value, str | DType):
        raise SpecError(f"{where}: dtype must be a string such as 'bfloat16', got {_kind(value)}")
    try:
        return DType.parse(value)
    except SpecError as e:
        raise SpecError(f"{where}: {e}") from None


def _optional_number(data: Mapping[str, Any], key: str, where: str) -> float | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise SpecError(f"{where}: {key} must be a positive number, got {_kind(value)}")
    return value
