"""The one rule that turns a GPU into a cache budget, shared by ``hybridkv plan`` and ``hybridkv simulate``.

    cache per GPU = utilization x GPU memory - weights per GPU - reserve, rounded down to whole GiB

with utilization 0.9 (vLLM's default) and a reserve of :data:`DEFAULT_RESERVE_BYTES` (6 GiB) for
activations and CUDA graphs by default: an 8,192-token MiniMax-M1 prefill chunk needs several GiB
that the cache cannot have. MiniMax-M1 TP8 on H200s: 0.9 x 140.4 - 106.2 - 6 = 14.2, so 14 GiB.
"""

from __future__ import annotations

from typing import NamedTuple

from hybridkv.units import format_bytes

__all__ = ["DEFAULT_RESERVE_BYTES", "GIB", "CacheBudget", "cache_budget"]

GIB = 2**30
DEFAULT_RESERVE_BYTES = 6 * GIB


class CacheBudget(NamedTuple):
    """A cache budget per GPU and the terms it came from (bytes); ``budget_bytes`` may be <= 0."""

    budget_bytes: int
    gpu_name: str
    gpu_bytes: int
    utilization: float
    weights_bytes: int
    reserve_bytes: int

    def sum_text(self, weights_how: str = "") -> str:
        """The rule with this budget's figures, e.g. ``cache 14 GiB per GPU = 0.9 x H200 140.4 GiB -
        weights 106.2 GiB - reserve 6.0 GiB (activations, CUDA graphs), rounded down to whole GiB``."""
        how = f" ({weights_how})" if weights_how else ""
        whole = f"{self.budget_bytes // GIB} GiB" if self.budget_bytes > 0 else format_bytes(self.budget_bytes)
        return (
            f"cache {whole} per GPU = {self.utilization:g} x {self.gpu_name.upper()} {format_bytes(self.gpu_bytes)} "
            f"- weights {format_bytes(self.weights_bytes)}{how} - reserve {format_bytes(self.reserve_bytes)} "
            "(activations, CUDA graphs), rounded down to whole GiB"
        )


def cache_budget(
    gpu_name: str,
    gpu_bytes: int,
    weights_bytes: int,
    utilization: float = 0.9,
    reserve_bytes: int = DEFAULT_RESERVE_BYTES,
) -> CacheBudget:
    """The cache budget per GPU by the module's rule. Raises nothing: a budget under 1 GiB comes back
    as it is (``budget_bytes`` <= 0 when nothing is left) for the caller to refuse with its own flags."""
    left = int(utilization * gpu_bytes) - weights_bytes - reserve_bytes
    budget = (left // GIB) * GIB if left >= GIB else left
    return CacheBudget(budget, gpu_name, gpu_bytes, utilization, weights_bytes, reserve_bytes)
