"""One forward's cache: hybridkv's pools -> a fresh transformers cache -> back into the pools.

Before a forward, :meth:`PagedCache.build` gathers the rows' state sets (``hybridkv.ops.gather_states``)
into a new ``DynamicCache`` (``MiniMaxCache`` for MiniMax) and reads their past K/V through the block
tables. Recurrent layers get ``conv_kernel_size = K - 1`` (hybridkv keeps K - 1 conv columns,
transformers K: with K - 1 the model's causal conv sees exactly the columns it needs) and
``has_previous_state``. After the forward, :meth:`PagedCache.store` writes the new K/V at the slot
mapping and puts the last K - 1 conv columns and the recurrent state into the state buffers, which
stay *resident*: the next forward that reads exactly those sets (the next decode of the same batch)
reads them there, and they are scattered into the pool (:meth:`PagedCache.flush`) only before
anything else reads or writes it: a forward of other rows, or the plan's copies, swaps and host-tier
copies (the engine calls :meth:`PagedCache.invalidate` before them).

Rows of one forward have the same query length (shorter fresh rows left padded to it) and past
lengths that may differ: K/V are padded to the longest past and :func:`attention_mask` hides both
paddings (an additive ``[B, 1, T, P + T]`` mask); the left padding's K/V are not stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hybridkv.integrations.transformers.families import Family, UnsupportedModelError
from hybridkv.models.spec import DType, RecurrentLayerSpec
from hybridkv.ops import BlockPools, StateBuffers, allocate_state_buffers, gather_states, kv_cache_views, scatter_states
from hybridkv.ops._framework import resolve_backend, torch_dtype
from hybridkv.planner.layout import Layout


@dataclass(frozen=True)
class StateLayer:
    """A recurrent decoder layer: where its state lives and which components are conv / recurrent."""

    group: int
    slot: int
    conv: str | None  # component name of the conv state (K - 1 columns), if any
    conv_columns: int
    recurrent: str | None  # component name of the recurrent state, if any


def _state_layers(layout: Layout) -> dict[int, StateLayer]:
    out: dict[int, StateLayer] = {}
    for g in range(layout.num_state_groups):
        for s in range(layout.group_size):
            entry = layout.state_layer(g, s)
            if entry is None:
                continue
            cache_id, spec = entry
            assert isinstance(spec, RecurrentLayerSpec)
            conv = [c for c in spec.components if c.name.startswith("conv")]
            rec = [c for c in spec.components if not c.name.startswith("conv")]
            if len(conv) > 1 or len(rec) > 1:
                raise UnsupportedModelError(
                    f"layer {layout.decoder_layer_id(cache_id)} of {layout.model.name!r} keeps "
                    f"{[c.name for c in spec.components]}: the runner maps one conv and one recurrent state"
                )
            out[layout.decoder_layer_id(cache_id)] = StateLayer(
                g, s, conv[0].name if conv else None, conv[0].shape[-1] if conv else 0, rec[0].name if rec else None
            )
    return out


def _stored_narrow(layout: Layout) -> bool:
    """Whether a state component is kept int8 / fp8 (with scales) or float16 in the pool."""
    comps = (c for _, r in layout.model.recurrent_layers() for c in r.components)
    return any(c.dtype.quantized or c.dtype is DType.FLOAT16 for c in comps)


def attention_mask(
    past_lens: list[int],
    num_tokens: int,
    dtype: torch.dtype,
    pads: list[int] | None = None,
    past_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Additive mask ``[B, 1, T, P + T]`` (``P = max(past_lens)``): row ``b``'s query ``i`` sees its own
    past ``0..past_lens[b]-1`` and the new tokens ``pads[b]..i``; the padded past is hidden. Row ``b``'s
    first ``pads[b]`` new tokens are left padding: no real query sees them, and each sees only itself
    (so no row of the softmax is empty). ``past_valid`` (bool ``[B, P]``): the past positions each row
    sees, where its past is not ``0..past_lens[b]-1`` (K/V kept from the last forward, its padding in
    place)."""
    if past_valid is None:
        past_valid = torch.arange(max(past_lens))[None, :] < torch.tensor(past_lens)[:, None]
    p = past_valid.shape[1]
    keys = torch.arange(p + num_tokens)
    q = torch.arange(num_tokens)
    past = torch.nn.functional.pad(past_valid, (0, num_tokens))  # [B, P + T]
    new = (keys[None, :] >= p) & (keys[None, :] - p <= q[:, None])  # [T, P + T]
    allowed = past[:, None, :] | new[None, :, :]  # [B, T, P + T]
    if pads is not None and any(pads):
        pad = torch.tensor(pads)[:, None]  # [B, 1]
        allowed &= ~((keys[None, :] >= p) & (keys[None, :] - p < pad))[:, None, :]  # pads hidden
        is_pad = q[None, :] < pad  # [B, T]
        itself = keys[None, :] - p == q[:, None]  # [T, P + T]
        allowed = torch.where(is_pad[:, :, None], itself[None], allowed)
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def _same_dtype(state: torch.Tensor, pool: torch.Tensor, layer: int) -> torch.Tensor:
    """``state`` as the model's code produced it, refused when the pool keeps another dtype (a silent
    cast would change what the next forward reads)."""
    if state.dtype != pool.dtype:
        raise UnsupportedModelError(
            f"layer {layer}: the model keeps its state in {state.dtype}, hybridkv's description of the model in "
            f"{pool.dtype}: the reader (hybridkv.models.hf) and the model disagree"
        )
    return state


def _put(buffer: torch.Tensor, state: torch.Tensor, layer: int) -> None:
    """``buffer[...] = state`` (the model's state, dtype checked), skipped where the model updated the
    buffer in place (the cache was handed views of the buffers)."""
    state = _same_dtype(state, buffer, layer)
    if state.data_ptr() != buffer.data_ptr() or state.stride() != buffer.stride() or state.shape != buffer.shape:
        buffer.copy_(state)


@dataclass(frozen=True)
class _LastKV:
    """The K/V a forward left (``[B, H, P, D]`` per attention layer, ``valid`` ``[B, P]``: which of
    those positions hold a row's tokens), for the next forward of the same rows."""

    tables: np.ndarray  # [B, W] the rows' block tables
    past_lens: np.ndarray  # [B] the rows' tokens after that forward
    valid: torch.Tensor
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]

    def follows(self, block_tables: np.ndarray, past_lens: list[int], block_size: int) -> bool:
        """Whether a forward of these rows reads exactly this K/V: the same rows in the same order,
        nothing computed in between."""
        b = len(past_lens)
        if b != self.past_lens.size or not np.array_equal(self.past_lens, past_lens):
            return False
        used = -(-self.past_lens // block_size)  # [B] blocks holding each row's tokens (the rest: stale)
        n = int(used.max())
        if block_tables.shape[1] < n or self.tables.shape[1] < n:
            return False
        own = np.arange(n)[None, :] < used[:, None]
        return bool(((block_tables[:b, :n] == self.tables[:, :n]) | ~own).all())


class PagedCache:
    """Moves K/V and recurrent states between the pools and transformers cache objects.

    Owns one :class:`~hybridkv.ops.StateBuffers` of ``max_rows`` rows, reused by every forward; the
    pools are the caller's. ``model_config``: the transformers config the caches are built from.
    """

    def __init__(self, family: Family, model_config, layout: Layout, pools: BlockPools, max_rows: int) -> None:
        self.family, self.config, self.layout, self.pools = family, model_config, layout, pools
        self.block_size = layout.block_size
        self.num_layers = layout.num_decoder_layers
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        kv = layout.kv_group
        views = kv_cache_views(pools)
        ids = [lid for lid in (kv.layer_ids if kv is not None else ()) if lid is not None]
        for n, cache_id in enumerate(ids):
            self.kv[layout.decoder_layer_id(cache_id)] = (views[2 * n], views[2 * n + 1])
        self.states = _state_layers(layout)
        self.backend = resolve_backend("auto", pools.device)  # once, not per gather / scatter
        # the state tables [G, B, bps] whose states the buffers hold (the last store's): the next
        # forward that reads exactly those sets (consecutive decodes of one batch) gathers nothing;
        # _dirty: the pool does not have them yet (flush() scatters them)
        self._resident: np.ndarray | None = None
        # int8 / fp8 / float16 states (EngineConfig.state_dtype): the buffers hold them in float32, as
        # transformers computes recurrent states; gather dequantizes, scatter quantizes (nearest)
        self.compute = torch.float32 if _stored_narrow(layout) else None
        self._dirty = False
        self._kv_last: _LastKV | None = None  # the last forward's K/V (store()), for the same rows' next
        self._pending: tuple = ()  # (block tables, past lens, past_valid) of the forward being run
        self.past_valid = torch.zeros(0, 0, dtype=torch.bool)  # [B, P] the built cache's real past positions
        self.buffers: StateBuffers | None = (
            allocate_state_buffers(layout, max_rows, device=pools.device, compute_dtype=self.compute)
            if self.states
            else None
        )

    # ---- before the forward ---------------------------------------------------------------------
    def new_cache(self):
        if self.family.cache == "minimax":
            from transformers.cache_utils import DynamicLayer
            from transformers.models.minimax.modeling_minimax import MiniMaxCache

            cache = MiniMaxCache()
            cache.layers = [DynamicLayer() for _ in range(self.num_layers)]
            cache.linear_cache = [None] * self.num_layers
            return cache
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    def build(
        self,
        block_tables: np.ndarray,
        past_lens: list[int],
        state_tables: np.ndarray | None,
        has_initial_state: bool,
        out_tables: np.ndarray | None = None,
    ):
        """A fresh cache for ``B`` rows: past K/V of ``past_lens`` tokens through ``block_tables``
        ``[B, W]`` and, when ``has_initial_state``, the states of ``state_tables`` ``[G, B, bps]``.
        ``out_tables``: the sets :meth:`store` will write (None: unknown)."""
        cache = self.new_cache()
        b, p = len(past_lens), max(past_lens)
        last, self._kv_last = self._kv_last, None
        self.past_valid = torch.arange(p)[None, :] < torch.tensor(past_lens)[:, None]  # [B, P]
        if p and self.kv:
            if last is not None and last.follows(block_tables, past_lens, self.block_size):
                # the next forward of the same rows (a decode): the last forward's K/V as it left
                # them, with its padding (hidden by past_valid) still in place, as generate keeps them
                kv, self.past_valid = last.kv, last.valid
            else:
                kv = self._gather_kv(block_tables, past_lens)
            for lid, (keys, values) in kv.items():
                layer = cache.layers[lid]
                layer.lazy_initialization(keys, values)
                layer.keys, layer.values = keys, values
                if hasattr(layer, "cumulative_length"):
                    layer.cumulative_length = keys.shape[2]
        self._pending = (block_tables[:b].copy(), np.asarray(past_lens), self.past_valid)
        if self.states:
            resident = self._resident is not None and has_initial_state
            if not (resident and np.array_equal(state_tables, self._resident)):
                self.flush()  # (the buffers are about to hold other rows' states)
                if has_initial_state:
                    gather_states(self.pools, state_tables, None, self.buffers, backend=self.backend)
            elif out_tables is None or not np.array_equal(out_tables, state_tables):
                self.flush()  # the forward reads these sets and writes others (a draft): they keep theirs
            # the forward changes the buffers: resident again once store() has the model's states
            # (a forward that raises loses only its own rows' states, and the engine aborts them)
            self._resident, self._dirty = None, False
        if has_initial_state and self.states:
            bufs = self.buffers
            # the cache takes views of the buffers, not copies: the states the model leaves are
            # read back by store()
            for lid, sl in self.states.items():
                comps = bufs.layer(sl.group, sl.slot)
                if self.family.cache == "minimax":
                    cache.linear_cache[lid] = comps[sl.recurrent][:b]
                    continue
                layer = cache.layers[lid]
                if sl.conv is not None:
                    layer.conv_states[0] = comps[sl.conv][:b]
                    layer.conv_kernel_size[0] = sl.conv_columns
                    layer.is_conv_states_initialized[0] = True
                if sl.recurrent is not None:
                    layer.recurrent_states[0] = comps[sl.recurrent][:b]
                    layer.is_recurrent_states_initialized[0] = True
                layer.has_previous_state[0] = True
                layer.device, layer.dtype = comps[sl.recurrent or sl.conv].device, comps[sl.conv or sl.recurrent].dtype
        return cache

    def _gather_kv(self, block_tables: np.ndarray, past_lens: list[int]) -> dict[int, tuple[torch.Tensor, ...]]:
        """Each attention layer's past K/V ``[B, H, P, D]`` read through ``block_tables`` (``P =
        max(past_lens)``; a row's positions past its length zeroed: the pool may hold NaN there)."""
        b, p = len(past_lens), max(past_lens)
        n = -(-p // self.block_size)
        tables = torch.from_numpy(block_tables[:b, :n].astype(np.int64))  # [B, n] (past a row's end: stale)
        pad = ~self.past_valid[:, None, :, None]  # [B, 1, P, 1]
        out = {}
        for lid, (k_view, v_view) in self.kv.items():
            kv = []
            for view in (k_view, v_view):  # whole blocks at once, then [B, H, P, D]
                x = view[tables].transpose(1, 2)  # [B, H, n, block_size, D] (MLA: [.., segments, width])
                # (out of place: for one block the reshape is a view of the pool)
                kv.append(x.reshape(b, x.shape[1], n * self.block_size, -1)[:, :, :p].masked_fill(pad, 0))
            out[lid] = (kv[0], kv[1])
        return out

    # ---- after the forward ----------------------------------------------------------------------
    def store(
        self,
        cache,
        past_lens: list[int],
        slot_mapping: np.ndarray,
        out_tables: np.ndarray | None,
        real: torch.Tensor | None = None,
    ) -> None:
        """Write the forward's new K/V (``[B, H, T, D]`` after the padded past) of the real tokens
        (``real`` bool ``[B, T]``, None: all; left padding is not stored) at ``slot_mapping`` (one slot
        per real token, row-major) and put each row's state in the state buffers for ``out_tables``
        ``[G, B, bps]`` (resident: scattered into the pool by :meth:`flush`; at once where two rows
        write one set). The forward's K/V are kept for the same rows' next forward."""
        b, p = len(past_lens), self.past_valid.shape[1]
        if self.kv:
            slots = torch.from_numpy(slot_mapping.astype(np.int64))
            blk, off = slots // self.block_size, slots % self.block_size
            keep = None if real is None else real.reshape(-1).nonzero()[:, 0]
            for lid, (k_view, v_view) in self.kv.items():
                layer = cache.layers[lid]
                for view, new in ((k_view, layer.keys), (v_view, layer.values)):
                    new = new[:, :, p:].transpose(1, 2)  # [B, T, H, D]
                    new = new.reshape(-1, *new.shape[2:]) if keep is None else new.flatten(0, 1)[keep]
                    view[blk, :, off] = new.reshape(len(slots), *view.shape[1:2], *view.shape[3:]).to(view.dtype)
            tables, past, valid = self._pending
            t = cache.layers[next(iter(self.kv))].keys.shape[2] - p
            new_valid = torch.ones(b, t, dtype=torch.bool) if real is None else real
            kv = {lid: (cache.layers[lid].keys, cache.layers[lid].values) for lid in self.kv}
            done = past + (t if real is None else real.sum(1).numpy())
            self._kv_last = _LastKV(tables, done, torch.cat((valid, new_valid), 1), kv)
        if not self.states or out_tables is None:
            return
        bufs = self.buffers
        for lid, sl in self.states.items():
            comps = bufs.layer(sl.group, sl.slot)
            if self.family.cache == "minimax":
                _put(comps[sl.recurrent][:b], cache.linear_cache[lid], lid)
                continue
            layer = cache.layers[lid]
            if sl.conv is not None:
                conv = layer.conv_states[0]
                _put(comps[sl.conv][:b], conv[..., conv.shape[-1] - sl.conv_columns :], lid)
            if sl.recurrent is not None:
                _put(comps[sl.recurrent][:b], layer.recurrent_states[0], lid)
        ids = out_tables[out_tables != 0]
        # (a narrow stored state differs from the buffers, which keep what the model computed: it is
        # scattered now and the next forward reads the pool's)
        if self.compute is None and np.unique(ids).size == ids.size:  # resident, scattered by flush()
            self._resident, self._dirty = out_tables.copy(), True
        else:  # (or a set written by two rows, in the pool once: scattered now, read back from the pool)
            scatter_states(self.pools, out_tables, None, bufs, backend=self.backend)

    def flush(self) -> None:
        """Scatter the resident states (the last :meth:`store`'s) into their sets in the pool, if the
        pool does not have them yet. The buffers stay resident."""
        if self._dirty:
            scatter_states(self.pools, self._resident, None, self.buffers, backend=self.backend)
            self._dirty = False

    def invalidate(self) -> None:
        """Before anything other than this cache reads or writes the pool (copies, swaps, the host
        tier, a caller reading the pool): the resident states are flushed into the pool, and the next
        forward gathers its states and K/V from it."""
        self.flush()
        self._resident, self._kv_last = None, None

    def discard(self) -> None:
        """Forget the resident states and K/V without writing them (after a flush that raised)."""
        self._resident, self._dirty, self._kv_last = None, False, None

    def state_dtypes(self) -> dict[int, dict[str, torch.dtype]]:
        """Decoder layer -> component -> the dtype the pool keeps it in (hybridkv's model description)."""
        out = {}
        for lid, sl in self.states.items():
            spec = self.layout.state_layer(sl.group, sl.slot)[1]
            narrow = self.compute is not None
            out[lid] = {
                c.name: self.compute
                if narrow and (c.dtype.quantized or c.dtype is DType.FLOAT16)
                else torch_dtype(c.dtype)
                for c in spec.components
            }
        return out
