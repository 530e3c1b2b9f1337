"""Errors of the transfer room: every message says what was asked, what happened and what to do."""

from __future__ import annotations

from hybridkv.blockmgr.errors import HybridKVError


class TransferError(HybridKVError):
    """A transfer could not be described, started or finished; the caller aborts its plans."""


class TransferTimeoutError(TransferError, TimeoutError):
    """A transfer or its notification did not complete within the caller's timeout."""


class TransferUnavailableError(TransferError, ImportError):
    """The transfer engine's package is not installed (``pip install 'hybridkv[transfer]'``)."""
