"""The hybrid block manager: KV blocks and recurrent state sets of every request in one pool.

Contract (DESIGN.md "Manager contract"): check-then-act pairs; every mutation is atomic (all
checks happen before the first change, so on any error nothing changed); every count is in blocks
and admission uses exactly the count allocation takes (``blocks_to_admit``).

Ownership: the manager owns every block id it hands out. Callers get numpy views (block tables,
state tables, copy lists, swap plans) that stay valid until the next mutating call.

Where each operation lives (each part subclasses :class:`~hybridkv.blockmgr.lifecycle.ManagerCore`,
so arrows go down only):

- :mod:`~hybridkv.blockmgr.lifecycle`: the one count, pins, ``allocate`` / ``append`` / ``free`` /
  ``fork``, ``mark_computed``, block and state tables, ``usage``;
- :mod:`~hybridkv.blockmgr.checkpointing`: ``checkpoint``, ``next_checkpoint_position``;
- :mod:`~hybridkv.blockmgr.speculation`: ``begin_speculation``, ``commit_speculation``;
- :mod:`~hybridkv.blockmgr.swap`: ``swap_out``, ``swap_in`` and their plans;
- :mod:`~hybridkv.blockmgr.transfer_plans`: ``export_request``, ``import_request`` (disaggregation);
- :mod:`~hybridkv.blockmgr.integrity`: ``check_integrity``;
- :mod:`~hybridkv.blockmgr.prefix`: the prefix cache the manager owns (through its ``CacheHost`` view).
"""

from __future__ import annotations

from hybridkv.blockmgr.checkpointing import CheckpointMixin
from hybridkv.blockmgr.integrity import check_integrity
from hybridkv.blockmgr.lifecycle import ManagerCore
from hybridkv.blockmgr.prefix import PrefixCacheConfig
from hybridkv.blockmgr.speculation import SpeculationMixin
from hybridkv.blockmgr.swap import SwapMixin
from hybridkv.blockmgr.transfer_plans import TransferMixin

__all__ = ["HybridBlockManager", "ManagerCore", "PrefixCacheConfig"]


class HybridBlockManager(CheckpointMixin, SpeculationMixin, SwapMixin, TransferMixin, ManagerCore):
    """Per-request lifecycle over one :class:`~hybridkv.blockmgr.pool.BlockPool` laid out by a
    :class:`~hybridkv.planner.layout.Layout`, with prefix caching, checkpoints, speculation, swap
    and transfer plans (see the module docstring for where each lives).

    ``num_host_blocks``: size of the host (CPU) swap pool, 0 = no swap. ``watermark``: fraction of
    usable blocks admission keeps free for running requests to grow into. ``prefix_cache``: a
    :class:`~hybridkv.blockmgr.prefix.PrefixCacheConfig` to cache prefixes (None: no cache).
    """

    def check_integrity(self) -> None:
        """Raise :class:`~hybridkv.errors.IntegrityError` listing every way the books do
        not balance."""
        check_integrity(self)
