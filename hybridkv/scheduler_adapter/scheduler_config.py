"""The scheduler's configuration and the argument checks its entry points share (``Scheduler`` in
:mod:`hybridkv.scheduler_adapter.scheduler`). Numpy only."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from hybridkv.scheduler_adapter.cost import H200, GpuSpec, PreemptionMode
from hybridkv.scheduler_adapter.requests import AdmissionPolicy, SchedRequest
from hybridkv.units import is_integer


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    num_speculative_tokens: int = 0  # k drafts per decoding request and step
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE
    gpu: GpuSpec = field(default=H200)  # for PreemptionMode.AUTO
    chunked_prefill: bool = True
    admission: AdmissionPolicy = AdmissionPolicy.RESERVED  # (or its value: "reserved", ...)
    # RESERVED: decode steps of room kept per running request (None: all its remaining outputs)
    decode_reserve_steps: int | None = 32

    def __post_init__(self) -> None:
        object.__setattr__(self, "admission", AdmissionPolicy(self.admission))
        if self.decode_reserve_steps is not None and (
            not is_integer(self.decode_reserve_steps) or self.decode_reserve_steps < 0
        ):
            raise ValueError(f"decode_reserve_steps must be an integer >= 0 or None, got {self.decode_reserve_steps!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.num_speculative_tokens < 0:
            raise ValueError(
                f"max_num_seqs and max_num_batched_tokens must be >= 1 and num_speculative_tokens >= 0, got "
                f"{self.max_num_seqs}, {self.max_num_batched_tokens}, {self.num_speculative_tokens}"
            )
        if self.max_num_batched_tokens <= self.num_speculative_tokens:
            raise ValueError("max_num_batched_tokens must exceed num_speculative_tokens: a decode runs 1 + k tokens")


def request_key(req: SchedRequest) -> tuple[int, int]:
    return req.sort_key


_INT64 = (-(1 << 63), (1 << 63) - 1)


def check_hashable(request_id: object) -> None:
    """``TypeError`` for a request id that cannot key the scheduler's and manager's books."""
    try:
        hash(request_id)
    except TypeError:
        raise TypeError(f"request ids must be hashable, got {type(request_id).__name__}") from None


def token_ids(tokens: object, what: str) -> tuple[int, ...]:
    """``tokens`` as a tuple of Python ints, each an integer (numpy integers included; bools,
    floats, strings and None refused) within int64; ``TypeError`` otherwise, before any change."""
    if isinstance(tokens, (str, bytes, bytearray, memoryview)) or not isinstance(tokens, Iterable):
        raise TypeError(f"{what} must be a sequence of integer token ids, got {type(tokens).__name__}")
    if isinstance(tokens, np.ndarray) and tokens.dtype.kind in "iu" and tokens.ndim == 1:
        out = tuple(tokens.tolist())  # (uint64 beyond int64 is caught below)
    else:
        out = []
        for t in tokens:  # type: ignore[attr-defined]
            if type(t) is not int:
                if not is_integer(t):
                    raise TypeError(f"{what} must be integer token ids, got {t!r} ({type(t).__name__})")
                t = int(t)
            out.append(t)
        out = tuple(out)
    if out and not (_INT64[0] <= min(out) and max(out) <= _INT64[1]):
        raise TypeError(f"{what} must fit int64, got {min(out)}..{max(out)}")
    return out
