"""The package's typed errors, now :mod:`hybridkv.errors` (this name keeps working)."""

from hybridkv.errors import (  # noqa: F401
    AllocationError,
    DuplicateRequestError,
    HostPoolExhaustedError,
    HybridKVError,
    IntegrityError,
    LayoutError,
    NoFreeBlocksError,
    RequestStateError,
    RequestTooLargeError,
    SpecError,
    TensorParallelError,
    UnknownRequestError,
)
