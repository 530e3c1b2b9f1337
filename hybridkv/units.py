"""Small unit helpers shared by the whole package: one ``cdiv``, size and token-count parsing."""

from __future__ import annotations

import enum
import math
import re
from typing import TypeVar

import numpy as np

_E = TypeVar("_E", bound=enum.Enum)

_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_COUNT_UNITS = {"": 1, "k": 1024, "m": 1024**2}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ``a`` by positive ``b``."""
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    """Smallest multiple of ``b`` that is ``>= a``."""
    return cdiv(a, b) * b


def _parse(text: str | int, units: dict[str, int], what: str, examples: str) -> int:
    if isinstance(text, int):
        value, unit = float(text), ""
    else:
        m = _NUMBER.match(text)
        if not m or m.group(2).lower() not in units:
            raise ValueError(f"cannot read {text!r} as a {what}: write e.g. {examples}")
        value, unit = float(m.group(1)), m.group(2).lower()
    result = int(value * units[unit])
    if result <= 0:
        raise ValueError(f"{what} {text!r} must be positive")
    return result


def parse_bytes(text: str | int) -> int:
    """Parse ``"80GiB"``, ``"141GB"``, ``"512MiB"`` or a plain integer into bytes.

    Decimal units (KB, MB, GB) are powers of 1000, binary units (KiB, MiB, GiB) powers of 1024.
    Raises ``ValueError`` with the accepted forms on anything else.
    """
    return _parse(text, _BYTE_UNITS, "size", "80GiB, 141GB, 512MiB or a byte count")


def parse_tokens(text: str | int) -> int:
    """Parse a token count: ``"32k"`` = 32768, ``"1m"`` = 1048576, ``"4096"`` = 4096."""
    return _parse(text, _COUNT_UNITS, "token count", "32k, 4096 or 1m")


def format_bytes(num_bytes: float) -> str:
    """Human-readable binary size, e.g. ``280.0 MiB``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def as_count(value: object, what: str, minimum: int = 0) -> int:
    """``value`` as a Python int count ``>= minimum``: ints and numpy integers pass; floats (even
    ``8.0``), strings and bools raise ``TypeError``, values below ``minimum`` ``ValueError``.
    Called before any change, so a bad argument leaves everything as it was."""
    count = value
    if type(value) is not int:  # (a plain int, the usual case, needs no conversion)
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            raise TypeError(f"{what} must be an integer, got {value!r} ({type(value).__name__})")
        count = value.__index__()  # type: ignore[attr-defined]
    if count < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {count}")
    return count


def is_integer(value: object) -> bool:
    """An exact integer: ``int`` or a numpy integer; bools, floats (even ``2.0``) and strings are not."""
    return type(value) is int or isinstance(value, np.integer)


# ---- configuration fields: one check each, a one-line message naming the field, the value and what is allowed
def as_flag(value: object, what: str) -> bool:
    """``value`` as a bool: ``True`` / ``False`` (numpy bools too); anything else (``"no"``, ``1``,
    None) raises ``TypeError`` rather than being read by its truth value."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{what} must be True or False, got {value!r} ({type(value).__name__})")


def as_real(value: object, what: str, minimum: float | None = None, maximum: float | None = None) -> float:
    """``value`` as a finite Python float in ``[minimum, maximum]``: ints, floats and numpy numbers
    pass; bools, strings and None raise ``TypeError``, nan, infinities and values out of range
    ``ValueError``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{what} must be a number, got {value!r} ({type(value).__name__})")
    number = float(value)
    low = -math.inf if minimum is None else minimum
    high = math.inf if maximum is None else maximum
    if not (math.isfinite(number) and low <= number <= high):
        bounds = [f">= {minimum:g}"] if minimum is not None else []
        bounds += [f"<= {maximum:g}"] if maximum is not None else []
        allowed = " and ".join(bounds) or "(not nan or infinite)"
        raise ValueError(f"{what} must be a finite number {allowed}, got {value!r}")
    return number


def as_choice(value: object, kind: type[_E], what: str) -> _E:
    """``value`` as a member of the enum ``kind``: a member, or its value (a string). ``ValueError``
    listing the valid values for an unknown one, ``TypeError`` for other types."""
    if isinstance(value, kind):
        return value
    valid = ", ".join(str(m.value) for m in kind)
    if not isinstance(value, str):
        raise TypeError(f"{what} must be one of {valid} (or a {kind.__name__}), got {value!r} ({type(value).__name__})")
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{what} must be one of {valid}, got {value!r}") from None
