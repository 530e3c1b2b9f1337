"""The scheduler's configuration and the argument checks its entry points share (``Scheduler`` in
:mod:`hybridkv.scheduler_adapter.scheduler`). Numpy only."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from hybridkv.scheduler_adapter.gpu import H200, GpuSpec, PreemptionMode
from hybridkv.scheduler_adapter.requests import AdmissionPolicy, SchedRequest
from hybridkv.units import as_choice, as_count, as_flag, is_integer


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Every field is checked at construction (:meth:`__post_init__`, the one place): counts are
    integers (numpy integers pass and become ints; bools, floats, nan and inf raise ``TypeError``)
    in range (``ValueError``), flags are bools, policies are members of their enum or its value
    (``"recompute"``, ``"full_prompt"``: turned into the member; unknown ones raise ``ValueError``
    listing the valid values)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    num_speculative_tokens: int = 0  # k drafts per decoding request and step
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE  # (or its value: "recompute", "swap", "auto")
    gpu: GpuSpec = field(default=H200)  # for PreemptionMode.AUTO
    chunked_prefill: bool = True
    admission: AdmissionPolicy = AdmissionPolicy.RESERVED  # (or its value: "reserved", ...)
    # RESERVED: decode steps of room kept per running request (None: all its remaining outputs)
    decode_reserve_steps: int | None = 32

    def __post_init__(self) -> None:
        put = object.__setattr__  # (frozen: the checked values replace the given ones)
        put(self, "max_num_seqs", as_count(self.max_num_seqs, "max_num_seqs", minimum=1))
        put(self, "max_num_batched_tokens", as_count(self.max_num_batched_tokens, "max_num_batched_tokens", minimum=1))
        put(self, "num_speculative_tokens", as_count(self.num_speculative_tokens, "num_speculative_tokens"))
        # the preemptor and the scheduler test the mode by identity: a string must become the member
        put(self, "preemption_mode", as_choice(self.preemption_mode, PreemptionMode, "preemption_mode"))
        if not isinstance(self.gpu, GpuSpec):
            raise TypeError(
                f"gpu must be a GpuSpec (e.g. hybridkv.scheduler_adapter.H200, or load_gpu('h100')), got {self.gpu!r}"
            )
        put(self, "chunked_prefill", as_flag(self.chunked_prefill, "chunked_prefill"))
        put(self, "admission", as_choice(self.admission, AdmissionPolicy, "admission"))
        if self.decode_reserve_steps is not None:
            put(self, "decode_reserve_steps", as_count(self.decode_reserve_steps, "decode_reserve_steps"))
        if self.max_num_batched_tokens <= self.num_speculative_tokens:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must exceed num_speculative_tokens "
                f"({self.num_speculative_tokens}): a decode runs 1 + k tokens"
            )


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
