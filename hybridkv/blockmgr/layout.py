"""The layout planner, now :mod:`hybridkv.planner.layout` (this name keeps working)."""

from hybridkv.planner.layout import (  # noqa: F401
    DEFAULT_BLOCK_SIZE,
    MAX_STATE_TAIL_FRACTION,
    NULL_BLOCK,
    PADDED_BLOCK_ALIGN,
    STATE_ONLY_BLOCK_BYTES_CHOICES,
    Capacity,
    Group,
    GroupKind,
    Layout,
    LayoutKind,
    RequestFootprint,
    Waste,
    plan,
)
