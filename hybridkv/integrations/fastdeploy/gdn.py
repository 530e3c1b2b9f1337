"""FastDeploy's GDN backend (Qwen3-Next / Qwen3.5 linear attention) over hybridkv's pool, worker side.

FastDeploy's open PR #7074 (branch commit ``ced07862``) adds ``cache_manager/gdn_state_pool.py``: a
``GDNStatePool`` of ``max_num_seqs + 1`` slots per GDN layer (conv state ``[conv_dim, kernel - 1]``
in bf16, SSM state ``[H, K, V]`` float32, slot 0 a zero sentinel) outside block accounting. Its
``layers/attention/gdn_backend.py`` reads, per layer, ``forward_meta.gdn_state_pool``
(``get_layer_conv_pool(gdn_layer_idx)`` ``[pool_size, conv_dim, kernel - 1]``,
``get_layer_ssm_pool(gdn_layer_idx)`` ``[pool_size, H, K, V]``) and ``forward_meta.gdn_slot_ids``
(``[batch]`` int32, -1 for padding, offset by +1 so -1 reads the sentinel), and its kernels update
the pool rows in place.

:class:`HybridGDNStatePool` answers the same two calls, so the backend runs unchanged, while the
states live in hybridkv's paged pool (the request's state sets, :class:`StateTables` rows) under the
same block count as KV, with prefix checkpoints and preemption. The paged state of one layer is not
one contiguous row (it spans ``blocks_per_state`` blocks and their K/V segments), so the view stages
**one layer at a time**: ``get_layer_*(i)`` writes the previously staged layer back to its blocks and
gathers layer ``i``'s states of the batch into a staging buffer of ``max_num_seqs + 1`` rows (row
``idx + 1`` = batch slot ``idx``, row 0 the zero sentinel); :meth:`HybridGDNStatePool.end_forward`
writes the last one back. Rows without an initial state (``has_initial_state`` False: the request
starts at position 0) are staged as zeros, as a fresh ``GDNStatePool`` slot reads. The staging holds
one layer's states of a full batch, ``1 / num_gdn_layers`` of the slot pool, and each step moves
every staged state twice (gather, write back): the cost of running FLA's slot-indexed kernels over
paged state until they take per-segment block tables (docs/fastdeploy.md, W5).

The index moves run in the caches' framework (Paddle: no torch). An int8 / fp8 ``ssm`` state is
staged as float32: dequantized when gathered, quantized per scale group (rounded to nearest: the
pool does not know the rows' positions) when written back, both on the host
(:mod:`hybridkv.ops.states.quant_np`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hybridkv.integrations.fastdeploy import tensors as tensors_
from hybridkv.integrations.fastdeploy.state import gather_state_bytes, scatter_state_bytes
from hybridkv.integrations.fastdeploy.worker import (
    PAD_BLOCK,
    FastDeployCaches,
    StateTables,
    _zeros,
)
from hybridkv.models.spec import RecurrentLayerSpec
from hybridkv.ops.states import quant_np

PAD_SLOT_ID = -1
"""``gdn_slot_ids`` of a batch row without a request (PR #7074's ``PAD_SLOT_ID``)."""


class HybridGDNStatePool:
    """Stands in ``forward_meta.gdn_state_pool``: PR #7074's two per-layer calls over paged state.

    ``caches`` / ``tables``: the worker's :class:`FastDeployCaches` and :class:`StateTables` (same
    layout). GDN layers are the model's recurrent layers of mixer ``"gdn"``, in layer order; the
    backend's ``layer.gdn_layer_idx`` is the position in :attr:`gdn_layer_ids`. Ownership: the
    staging buffers and ``slot_ids`` are allocated once (same tensors every step); the states are
    the pool's. Raises ``ValueError`` for a model without GDN layers or mismatched objects.
    """

    def __init__(self, caches: FastDeployCaches, tables: StateTables) -> None:
        if not isinstance(caches, FastDeployCaches) or not isinstance(tables, StateTables):
            raise TypeError(
                f"HybridGDNStatePool needs FastDeployCaches and StateTables, got {type(caches).__name__}, "
                f"{type(tables).__name__}"
            )
        layout = caches.layout
        if tables.layout is not layout and tables.layout != layout:
            raise ValueError("HybridGDNStatePool: the caches and the state tables were built for different layouts")
        slots = caches.layer_slots
        ids = [
            i
            for i, spec in enumerate(layout.model.layers)
            if isinstance(spec, RecurrentLayerSpec) and spec.mixer == "gdn" and i in slots
        ]
        if not ids:
            raise ValueError(f"model {layout.model.name!r} has no GDN (mixer 'gdn') layer")
        self.caches, self.tables, self.layout = caches, tables, layout
        self.gdn_layer_ids: tuple[int, ...] = tuple(ids)
        spec = layout.model.layers[ids[0]]
        assert isinstance(spec, RecurrentLayerSpec)
        if any(layout.model.layers[i] != spec for i in ids):
            raise ValueError("HybridGDNStatePool: GDN layers of different shapes share one staging buffer")
        comps = {c.name: c for c in spec.components}
        if set(comps) != {"ssm", "conv"}:
            raise ValueError(f"a GDN layer holds ssm and conv states, got {sorted(comps)}")
        self._offsets = spec.component_offsets()
        self._ssm, self._conv = comps["ssm"], comps["conv"]
        self._nbytes = spec.state_bytes
        rows = tables.max_num_seqs + 1
        fw, dev = caches.framework, caches.device
        staged = "float32" if self._ssm.dtype.quantized else self._ssm.dtype.value
        self.ssm_staging = _zeros(fw, (rows, *self._ssm.shape), staged, dev)
        self.conv_staging = _zeros(fw, (rows, *self._conv.shape), self._conv.dtype.value, dev)
        self.slot_ids = _zeros(fw, (tables.max_num_seqs,), "int32", dev)
        self.slot_ids[...] = PAD_SLOT_ID
        self._staged: int | None = None  # gdn_layer_idx in staging, not yet written back
        self._live = np.zeros(0, dtype=np.int64)  # batch slots with a request this forward
        self._fresh = np.zeros(0, dtype=bool)  # of those: no initial state (staged as zeros)

    # ---- the calls PR #7074's gdn_backend.py makes ------------------------------------------------
    def get_layer_conv_pool(self, layer_idx: int) -> Any:
        """Conv states of GDN layer ``layer_idx`` for this forward: ``[max_num_seqs + 1, conv_dim,
        kernel - 1]``, row ``idx + 1`` = batch slot ``idx``. Kernels update it in place."""
        self._stage(layer_idx)
        return self.conv_staging

    def get_layer_ssm_pool(self, layer_idx: int) -> Any:
        """SSM states of GDN layer ``layer_idx``: ``[max_num_seqs + 1, H, K, V]`` (K first, FLA's layout)."""
        self._stage(layer_idx)
        return self.ssm_staging

    @staticmethod
    def offset_slot_ids(raw_slot_ids: Any) -> Any:
        """Raw ids -> staging rows: ``-1 -> 0`` (the sentinel), ``idx -> idx + 1``, as PR #7074's."""
        return raw_slot_ids + 1

    # ---- the runner's side -------------------------------------------------------------------------
    def begin_forward(self, has_initial_state: Sequence[bool] | np.ndarray) -> Any:
        """Before the model forward, after ``tables.apply(tasks)`` and the tasks' ``state_copies``:
        ``has_initial_state`` bool ``[max_num_seqs]`` (``seq_lens_decoder > 0`` per batch slot).
        Sets ``slot_ids`` (``idx`` for slots holding a request, -1 else) in place and returns it, for
        ``forward_meta.gdn_slot_ids``. Raises ``RuntimeError`` if a staged layer was not written back."""
        if self._staged is not None:
            raise RuntimeError("begin_forward: the last forward's staged GDN layer was not written back (end_forward)")
        init = np.asarray(has_initial_state, dtype=bool).reshape(-1)
        if init.size != self.tables.max_num_seqs:
            raise ValueError(f"has_initial_state has {init.size} rows, max_num_seqs is {self.tables.max_num_seqs}")
        live = np.array([i for i, r in enumerate(self.tables.request_ids) if r is not None], dtype=np.int64)
        raw = np.full(self.tables.max_num_seqs, PAD_SLOT_ID, dtype=np.int32)
        raw[live] = live
        self.slot_ids[:] = tensors_.to_like(raw, self.slot_ids)
        self._live, self._fresh = live, ~init[live]
        return self.slot_ids

    def end_forward(self) -> None:
        """After the model forward: write the last staged layer back to its blocks."""
        self._write_back()

    # ---- staging -------------------------------------------------------------------------------------
    def _stage(self, layer_idx: int) -> None:
        if not isinstance(layer_idx, int | np.integer) or not 0 <= layer_idx < len(self.gdn_layer_ids):
            raise IndexError(f"gdn_layer_idx {layer_idx!r} outside [0, {len(self.gdn_layer_ids)})")
        if self._staged == layer_idx:
            return
        self._write_back()
        ssm, conv = self.ssm_staging, self.conv_staging
        ssm[...] = 0
        conv[...] = 0
        rows = self._rows(layer_idx)
        if rows is not None:
            slot = self.caches.layer_slots[self.gdn_layer_ids[layer_idx]]
            keep = np.flatnonzero(~self._fresh)
            if keep.size:  # fresh rows stay zero, as a fresh GDNStatePool slot reads
                data = gather_state_bytes(slot, self.layout, rows[keep], self._nbytes)
                ssm_v, conv_v = self._split(data)
                at = tensors_.index(ssm, self._live[keep] + 1)
                ssm[at] = ssm_v
                conv[at] = conv_v
        self._staged = layer_idx

    def _write_back(self) -> None:
        if self._staged is None:
            return
        layer_idx, self._staged = self._staged, None
        rows = self._rows(layer_idx)
        if rows is None:
            return
        ssm, conv = self.ssm_staging, self.conv_staging
        at = tensors_.index(ssm, self._live + 1)
        n, o = int(self._live.size), self._offsets
        if self._ssm.dtype.quantized:
            values = tensors_.to_numpy(tensors_.reshape(ssm[at], (n, -1)))
            c = self._ssm
            ssm_b = tensors_.to_like(quant_np.encode(values, c.dtype, c.scale_group), ssm)
        else:
            ssm_b = tensors_.view_dtype(tensors_.reshape(ssm[at], (n, -1)), "uint8")
        conv_b = tensors_.view_dtype(tensors_.reshape(conv[at], (n, -1)), "uint8")
        pieces = []
        for name, part in sorted((("ssm", ssm_b), ("conv", conv_b)), key=lambda item: o[item[0]]):
            gap = o[name] - sum(int(p.shape[1]) for p in pieces)
            if gap:  # bytes between components (none today) stay zero
                pieces.append(tensors_.zeros(ssm_b, (n, gap), "uint8"))
            pieces.append(part)
        slot = self.caches.layer_slots[self.gdn_layer_ids[layer_idx]]
        scatter_state_bytes(slot, self.layout, rows, tensors_.concat(pieces, axis=1))

    def _rows(self, layer_idx: int) -> np.ndarray | None:
        """The live slots' state sets in the group of GDN layer ``layer_idx``, ``[B, blocks_per_state]``."""
        if not self._live.size:
            return None
        group = self.caches.layer_slots[self.gdn_layer_ids[layer_idx]].group
        width = self.layout.blocks_per_state[group]
        rows = self.tables.numpy()[group][self._live, :width]
        if (rows == PAD_BLOCK).any():
            raise RuntimeError("a batch slot holding a request has no state set: apply the step's tasks first")
        return rows

    def _split(self, data: Any) -> tuple[Any, Any]:
        """Flat state bytes ``[B, nbytes]`` -> (ssm ``[B, H, K, V]``, conv ``[B, conv_dim, kernel - 1]``),
        in the staging buffers' framework."""
        o, b = self._offsets, int(data.shape[0])
        raw = data[:, o["ssm"] : o["ssm"] + self._ssm.nbytes].contiguous()
        if self._ssm.dtype.quantized:
            c = self._ssm
            ssm = tensors_.to_like(quant_np.decode(tensors_.to_numpy(raw), c.dtype, c.numel, c.scale_group), raw)
        else:
            ssm = tensors_.view_dtype(raw, self._ssm.dtype.value)
        conv = data[:, o["conv"] : o["conv"] + self._conv.nbytes].contiguous()
        conv = tensors_.view_dtype(conv, self._conv.dtype.value)
        return tensors_.reshape(ssm, (b, *self._ssm.shape)), tensors_.reshape(conv, (b, *self._conv.shape))


def attach_gdn(forward_meta: Any, pool: HybridGDNStatePool, has_initial_state: Sequence[bool] | np.ndarray) -> Any:
    """Patch W5 (``initialize_forward_meta``): ``forward_meta.gdn_state_pool`` is ``pool`` and
    ``forward_meta.gdn_slot_ids`` its ``slot_ids`` for this step (:meth:`HybridGDNStatePool.begin_forward`)."""
    if not isinstance(pool, HybridGDNStatePool):
        raise TypeError(f"attach_gdn needs a HybridGDNStatePool, got {type(pool).__name__}")
    forward_meta.gdn_slot_ids = pool.begin_forward(has_initial_state)
    forward_meta.gdn_state_pool = pool
    return forward_meta
