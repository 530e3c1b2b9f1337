"""Speculative decoding over state sets: speculative sets, commit by exchanging block-id lists."""

from __future__ import annotations

import numpy as np

from hybridkv.blockmgr.lifecycle import ManagerCore
from hybridkv.blockmgr.records import BlockCopies, BlockUse, RequestId
from hybridkv.errors import NoFreeBlocksError, RequestStateError
from hybridkv.planner.layout import NULL_BLOCK
from hybridkv.units import as_count, cdiv

_NO_COPIES = BlockCopies.empty()


class SpeculationMixin(ManagerCore):
    """Methods of :class:`~hybridkv.blockmgr.manager.HybridBlockManager`: a part that adds no state."""

    # ---- speculative decoding -------------------------------------------------------------------
    def begin_speculation(self, request_id: RequestId, num_speculative: int) -> None:
        """Guarantee ``num_speculative`` speculative state sets (allocating the missing ones).

        Convention of a verify step over ``1 + k`` tokens (the last sampled token and ``k`` drafts):
        the kernel reads the live set, writes the state after the sampled token back into the live
        set, and the state after draft ``j`` (1-based) into speculative set ``j - 1``.
        """
        rec = self._running(request_id)
        num_speculative = as_count(num_speculative, "num_speculative")
        if num_speculative and request_id in self._lent:
            raise RequestStateError(
                f"request {request_id!r}: its live sets are lent in place (PrefixCacheConfig.in_place_state), "
                "which does not combine with speculative decoding"
            )
        missing = num_speculative - rec.spec.shape[0]
        if missing > 0:
            need = missing * self.num_state_blocks
            if need > self.num_available_blocks:
                raise NoFreeBlocksError(
                    f"{num_speculative} speculative sets for {request_id!r}", need, self.num_available_blocks
                )
            rec.run = None
            new = self._split_state_sets(self._take(need), missing)
            self._mark_sets(new, BlockUse.SPECULATIVE)
            rec.spec = np.concatenate((rec.spec, new))
        rec.num_drafted = num_speculative

    def commit_speculation(
        self, request_id: RequestId, num_accepted: int, num_drafted: int | None = None
    ) -> None:
        """Keep the state after the last accepted token and drop the rejected tokens' KV.

        ``num_drafted`` defaults to the ``k`` of :meth:`begin_speculation`; the caller appended
        ``1 + num_drafted`` tokens for the verify step. The live set and speculative set
        ``num_accepted - 1`` exchange their block-id lists (no copy).
        """
        rec = self._running(request_id)
        k = rec.num_drafted if num_drafted is None else as_count(num_drafted, "num_drafted")
        num_accepted = as_count(num_accepted, "num_accepted")
        if not 0 <= num_accepted <= k or k > rec.spec.shape[0]:
            raise ValueError(
                f"num_accepted={num_accepted} must be in [0, {k}] with {rec.spec.shape[0]} speculative sets"
            )
        rejected = k - num_accepted
        if rejected > rec.num_tokens:
            raise ValueError(f"cannot reject {rejected} tokens of a request holding {rec.num_tokens}")
        if num_accepted:
            j = num_accepted - 1
            live = rec.state.copy()
            rec.state[...] = rec.spec[j]
            rec.spec[j] = live
            self._mark_sets(rec.state, BlockUse.STATE)
            self._mark_sets(rec.spec[j], BlockUse.SPECULATIVE)
        if rejected:
            rec.run = None
            rec.num_tokens -= rejected
            keep = cdiv(rec.num_tokens, self.block_size) if self._has_kv else 0
            self._drop_kv(rec.kv[keep : rec.num_kv_blocks].copy())
            rec.kv[keep : rec.num_kv_blocks] = NULL_BLOCK
            rec.num_kv_blocks = keep
            # the new tail may be partly filled again: a shared one is copied before it is written
            # (_needs_cow checks the reference count)

    def end_speculation(self, request_id: RequestId) -> None:
        """Give the speculative sets back (speculation turned off for this request)."""
        rec = self._running(request_id)
        rec.run = None
        self._drop_state(rec.spec)
        rec.spec = self._no_spec()
        rec.num_drafted = 0
