"""Errors of the transfer room: every message says what was asked, what happened and what to do."""

from __future__ import annotations

from hybridkv.errors import HybridKVError


class TransferError(HybridKVError):
    """A transfer could not be described, started or finished; the caller aborts its plans.

    ``in_flight``: the engine could not cancel a transfer that may still write into the destination's
    blocks; they must not be reused until the connection is dropped (do not abort the import plan).
    """

    def __init__(self, message: str, in_flight: bool = False) -> None:
        super().__init__(message)
        self.in_flight = in_flight


class TransferTimeoutError(TransferError, TimeoutError):
    """A transfer or its notification did not complete within the caller's timeout."""


class TransferUnavailableError(TransferError, ImportError):
    """The transfer engine's package is not installed (``pip install 'hybridkv[transfer]'``)."""


class HandoffRefusedError(TransferError):
    """This side cannot take a hand-off as it was offered (e.g. a request without its prompt's token
    ids on a decode role with no host pool to swap it to); nothing was reserved. Tell the prefill side
    to cancel it, or send it again with what the message says is missing."""
