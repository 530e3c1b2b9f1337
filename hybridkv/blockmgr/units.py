"""Unit helpers, now :mod:`hybridkv.units` (this name keeps working)."""

from hybridkv.units import (  # noqa: F401
    as_count,
    cdiv,
    format_bytes,
    parse_bytes,
    parse_tokens,
    round_up,
)
