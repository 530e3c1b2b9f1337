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


class AllocationError(HybridKVError):
    """An operation could not get the blocks it needs; nothing was changed."""


class NoFreeBlocksError(AllocationError):
    """The device pool has too few free (or evictable) blocks right now; retry after frees."""

    def __init__(self, what: str, needed: int, available: int, hint: str = "free or preempt requests") -> None:
        super().__init__(f"{what} needs {needed} blocks, {available} available: {hint}")
        self.needed = needed
        self.available = available


class RequestTooLargeError(AllocationError, ValueError):
    """The request can never fit, even in an empty pool: rejected up front."""

    def __init__(self, needed: int, total: int, what: str = "request") -> None:
        super().__init__(
            f"{what} needs {needed} blocks, pool has {total} in total: raise the memory budget "
            f"or lower max_model_len / the number of speculative tokens"
        )
        self.needed = needed
        self.total = total


class HostPoolExhaustedError(AllocationError):
    """The host (CPU) swap pool has too few free blocks for a swap-out."""

    def __init__(self, needed: int, available: int) -> None:
        super().__init__(
            f"swap-out needs {needed} host blocks, {available} free: raise num_host_blocks or preempt by recompute"
        )
        self.needed = needed
        self.available = available


class UnknownRequestError(HybridKVError, KeyError):
    """No request with this id is known to the manager."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0])


class DuplicateRequestError(HybridKVError, ValueError):
    """A request id that is already allocated was allocated again."""


class RequestStateError(HybridKVError):
    """The operation does not apply to the request in its current state (swapped, swap pending...)."""


class IntegrityError(HybridKVError, AssertionError):
    """``check_integrity()`` found the books do not balance; the message lists every problem."""
