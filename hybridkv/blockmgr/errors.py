"""Typed errors of hybridkv.

Every message says what was asked, what was there and what to change. All errors derive from
:class:`HybridKVError`; the ones caused by bad user input also derive from ``ValueError`` so that
generic callers can catch them the usual way.
"""

from __future__ import annotations


class HybridKVError(Exception):
    """Base class of every error hybridkv raises on purpose."""


class SpecError(HybridKVError, ValueError):
    """A model or layer spec is invalid (bad shape, unknown dtype, unknown preset, bad file)."""


class TensorParallelError(SpecError):
    """``tp_size`` does not divide a head or channel axis of the model."""


class LayoutError(HybridKVError, ValueError):
    """The planner cannot build a layout for the given model, block size and budget."""
