"""Lightning attention through the paged state: decode in place, prefill by gather -> block-wise -> scatter.

A lightning layer's state is one component ``[H, d_k, d_v]`` of a recurrent layer in the layout (state
group ``group``, layer slot ``slot``). Its bytes are found through the state table exactly as
:mod:`hybridkv.ops.addressing` lays them out (``state_byte_addresses`` for the reference paths, the
same rule in element units inside the Triton kernel). ``state_dtype`` may reinterpret the component's
bytes (e.g. float64 states stored in a component declared as float32 with twice the elements).

- :func:`lightning_decode`: one token per row, reading the state set of ``state_table`` and writing
  the updated state to ``out_table`` (default: the same set, in place). One Triton launch per call
  on CUDA (or with ``backend="triton"`` under ``TRITON_INTERPRET=1``); reference: gather the rows'
  states with the addressing rule, :func:`~.naive.lightning_decode_naive`, write them back.
- :func:`lightning_prefill`: packed sequences (``cu_seqlens``) with ``has_initial_state``, block-wise
  (Lightning Attention-2). Triton: one launch, in place (each program loads its state piece once,
  runs the row's blocks, writes it back). Reference: gather the rows' states with the addressing
  rule, :func:`~.naive.lightning_prefill_varlen_naive`, write them back.

Rows whose (output) set starts with the null block are padding: nothing is read or written, their
outputs are zero. Torch or Paddle tensors (Paddle through DLPack views, as the other ops).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from hybridkv.models.dtypes import DType
from hybridkv.ops._framework import (
    Backend,
    Framework,
    from_torch,
    is_paddle_tensor,
    resolve_backend,
    to_torch,
    torch_dtype,
)
from hybridkv.ops.addressing import state_byte_addresses
from hybridkv.ops.lightning import quantized
from hybridkv.ops.lightning.naive import (
    decay_factors,
    lightning_decode_naive,
    lightning_prefill_naive,
    lightning_prefill_varlen_naive,
    lightning_recurrent_naive,
    lightning_slopes,
)
from hybridkv.ops.pools import BlockPools
from hybridkv.ops.states.quant import region_salt
from hybridkv.planner.layout import NULL_BLOCK


class LightningLayer(NamedTuple):
    """Where one lightning layer's state lives: state group, layer slot, component, and how to read it."""

    group: int
    slot: int
    component_offset: int  # bytes, inside the layer's flat state
    num_heads: int
    dk: int
    dv: int
    dtype: torch.dtype  # the compute dtype of a quantized component (float32)
    state_bytes: int  # the whole layer state (all components)
    stored: DType | None = None  # int8 / float8_e4m3fn: values then float32 scales (None: stored as ``dtype``)
    scale_group: int = 0  # values per scale (d_v: row scales; d_k * d_v: head scales)
    salt: int = 0  # the stochastic-rounding salt (:func:`~hybridkv.ops.states.quant.region_salt`)
    stored_bytes: int = 0  # the component's bytes, scales included (quantized only)


def lightning_layer(
    pools: BlockPools,
    group: int,
    slot: int,
    component: str | None = None,
    state_dtype: torch.dtype | None = None,
    head_dims: tuple[int, int, int] | None = None,
) -> LightningLayer:
    """Geometry of the state component ``component`` (default: its only 3-D one) of the layer in (``group``, ``slot``).

    Without ``state_dtype`` the component's dtype and shape ``[H, d_k, d_v]`` are used; with it, ``head_dims``
    ``(H, d_k, d_v)`` (default: the component's shape with ``d_v`` rescaled to the new item size) must
    cover the component's bytes exactly. Raises ``ValueError`` otherwise.

    An int8 / float8_e4m3fn component (values then scales, row or head scales; ``state_dtype`` not
    given) is computed in float32: read dequantized, written back quantized. Per-tensor scales are
    refused: a head's new state could not be written before every head of the row is done.
    """
    layout = pools.layout
    if not 0 <= group < layout.num_state_groups:
        raise ValueError(f"state group {group} does not exist: the layout has {layout.num_state_groups}")
    entry = layout.state_layer(group, slot)
    if entry is None:
        raise ValueError(f"state group {group} has no layer in slot {slot}")
    spec = entry[1]
    if component is None:
        three_d = [c for c in spec.components if len(c.shape) == 3]
        if len(three_d) != 1:
            raise ValueError(f"layer in slot {slot} has {len(three_d)} [H, d_k, d_v] components: name one")
        c = three_d[0]
    else:
        c = spec.component(component)
    if len(c.shape) != 3:
        raise ValueError(f"a lightning state is [H, d_k, d_v], component {c.name!r} has shape {c.shape}")
    if c.dtype.quantized:
        if state_dtype is not None or head_dims is not None or c.scales == "tensor":
            raise ValueError(
                f"component {c.name!r} is {c.dtype.value} with {c.scales} scales: a quantized lightning state "
                "takes row or head scales and no state_dtype / head_dims"
            )
        off = spec.component_offsets()[c.name]
        salt = region_salt(entry[0], off)
        return LightningLayer(
            group, slot, off, *c.shape, torch.float32, spec.state_bytes, c.dtype, c.scale_group, salt, c.nbytes
        )
    dtype = torch_dtype(c.dtype) if state_dtype is None else state_dtype
    itemsize = torch.empty(0, dtype=dtype).element_size()
    h, dk, dv = c.shape
    if head_dims is not None:
        h, dk, dv = head_dims
    elif state_dtype is not None:
        dv = c.shape[2] * c.dtype.itemsize // itemsize
    off = spec.component_offsets()[c.name]
    if h * dk * dv * itemsize != c.nbytes:
        raise ValueError(f"[{h}, {dk}, {dv}] of {dtype} does not cover component {c.name!r} ({c.nbytes} bytes)")
    if off % itemsize or layout.segment_bytes % itemsize:
        raise ValueError(f"component offset {off} and segment bytes must be multiples of the {itemsize}-byte item")
    return LightningLayer(group, slot, off, h, dk, dv, dtype, spec.state_bytes)


def _table(state_table: Any, group: int) -> torch.Tensor:
    t = to_torch(state_table)
    if t.dim() == 3:
        t = t[group]
    if t.dim() != 2:
        raise ValueError(f"state table must be [num_state_groups, B, W] or [B, W], got shape {tuple(t.shape)}")
    return t


def _layer_addresses(pools: BlockPools, layer: LightningLayer, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte addresses ``[B, component bytes]`` in the layer slot and null flags, by :func:`state_byte_addresses`."""
    address, null = state_byte_addresses(pools.layout, pools.num_blocks, rows, layer.state_bytes)
    nbytes = layer.num_heads * layer.dk * layer.dv * torch.empty(0, dtype=layer.dtype).element_size()
    cut = slice(layer.component_offset, layer.component_offset + nbytes)
    return address[:, cut], null[:, cut]


def read_layer_states(pools: BlockPools, layer: LightningLayer, rows: torch.Tensor) -> torch.Tensor:
    """States ``[B, H, d_k, d_v]`` (new tensor) of the sets in ``rows`` (int ``[B, >= blocks_per_state]``);
    null-block bytes read as zeros. A quantized component reads dequantized (float32)."""
    if layer.stored is not None:
        return quantized.read_states(pools, layer, rows)
    address, null = _layer_addresses(pools, layer, rows.to(pools.torch_data.device, torch.int64))
    flat = pools.torch_data[layer.slot].reshape(-1)[address].masked_fill(null, 0)
    return flat.contiguous().view(layer.dtype).view(rows.shape[0], layer.num_heads, layer.dk, layer.dv)


def write_layer_states(
    pools: BlockPools, layer: LightningLayer, rows: torch.Tensor, states: torch.Tensor, seeds: Any = None
) -> None:
    """Write ``states`` ``[B, H, d_k, d_v]`` into the sets in ``rows``; null-block bytes are skipped. A
    quantized component is quantized here (``seeds`` int64 ``[B]``: stochastic rounding, else nearest)."""
    if layer.stored is not None:
        quantized.write_states(pools, layer, rows, states, seeds)
        return
    address, null = _layer_addresses(pools, layer, rows.to(pools.torch_data.device, torch.int64))
    data = states.to(layer.dtype).contiguous().view(rows.shape[0], -1).view(torch.uint8)
    keep = ~null
    pools.torch_data[layer.slot].view(-1)[address[keep]] = data[keep]


def _seeds(seeds: Any, b: int, device: Any) -> torch.Tensor | None:
    """int64 ``[B]`` seeds on ``device`` (None stays None). Raises ``ValueError`` when fewer than ``b``."""
    if seeds is None:
        return None
    t = to_torch(seeds)
    if t.numel() < b:
        raise ValueError(f"seeds has {t.numel()} entries, the batch {b} rows")
    return t.reshape(-1)[:b].to(device, torch.int64).contiguous()


def _live_rows(table: torch.Tensor) -> torch.Tensor:
    return table[:, 0] != NULL_BLOCK


def _check_distinct_outputs(table: torch.Tensor, width: int) -> None:
    ids = table[:, :width].cpu().numpy().astype(np.int64).ravel()
    ids = ids[ids != NULL_BLOCK]
    uniq, counts = np.unique(ids, return_counts=True)
    if (counts > 1).any():
        raise ValueError(
            f"block {int(uniq[counts > 1][0])} is written by two rows: every output set must own its blocks"
        )


def _framework_of(x: Any) -> Framework:
    return Framework.PADDLE if is_paddle_tensor(x) else Framework.TORCH


def lightning_decode(
    pools: BlockPools,
    state_table: Any,
    group: int,
    slot: int,
    q: Any,
    k: Any,
    v: Any,
    slopes: Any,
    out_table: Any | None = None,
    has_initial_state: Any | None = None,
    component: str | None = None,
    state_dtype: torch.dtype | None = None,
    backend: Backend | str = "auto",
    validate: bool | None = None,
    seeds: Any = None,
) -> Any:
    """One decode token per row through the paged state; returns ``o`` ``[B, H, d_v]`` (``v``'s dtype and framework).

    ``state_table``: int32 ``[num_state_groups, B, W]`` or ``[B, W]`` (``W >= blocks_per_state``): the set
    each row reads. ``out_table`` (same shape; default ``state_table``): the set each row writes; a row
    whose output set starts with the null block is skipped (output zero). ``has_initial_state`` bool
    ``[B]`` (default all True): False reads zeros. ``q``, ``k`` ``[B, H, d_k]``, ``v`` ``[B, H, d_v]``;
    ``slopes`` ``[H]`` (:func:`lightning_slopes`). ``validate`` (default: tables on the host) checks ids
    and that no block is written by two rows. Raises ``ValueError``.

    A quantized component (int8 / fp8, :func:`lightning_layer`) is read dequantized, updated in float32
    and written back quantized; ``seeds`` int64 ``[B]`` (e.g. ``rounding_seeds(request_ids, positions
    after the token)``, :mod:`hybridkv.ops.states.quant`) round stochastically, None to nearest.
    """
    pools.require_slot_major("lightning_decode")
    layer = lightning_layer(pools, group, slot, component, state_dtype)
    fw = _framework_of(v)
    qt, kt, vt = to_torch(q), to_torch(k), to_torch(v)
    b = qt.shape[0]
    if qt.shape != (b, layer.num_heads, layer.dk) or kt.shape != qt.shape or vt.shape != (b, layer.num_heads, layer.dv):
        raise ValueError(
            f"q, k {tuple(qt.shape)}, {tuple(kt.shape)} and v {tuple(vt.shape)} do not match the state "
            f"[{layer.num_heads}, {layer.dk}, {layer.dv}] for batch {b}"
        )
    t_in = _table(state_table, group)
    t_out = t_in if out_table is None else _table(out_table, group)
    bps = pools.layout.blocks_per_state[group]
    for t in (t_in, t_out):
        if t.shape[0] != b or t.shape[1] < bps:
            raise ValueError(f"state table rows {tuple(t.shape)}: expected [{b}, >= {bps}]")
    if validate or (validate is None and t_out.device.type == "cpu"):
        for t in (t_in, t_out):
            bad = t[:, :bps][(t[:, :bps] < 0) | (t[:, :bps] >= pools.num_blocks)]
            if bad.numel():
                raise ValueError(
                    f"state table holds block id {int(bad[0])}, outside the pool's 0..{pools.num_blocks - 1}"
                )
        _check_distinct_outputs(t_out, bps)
    init = (
        torch.ones(b, dtype=torch.bool, device=pools.torch_data.device)
        if has_initial_state is None
        else to_torch(has_initial_state).to(pools.torch_data.device, torch.bool)
    )
    slopes_t = to_torch(slopes)
    if resolve_backend(backend, pools.torch_data.device) is Backend.NAIVE:
        live = _live_rows(t_out).to(pools.torch_data.device)
        states = read_layer_states(pools, layer, t_in)
        states[~(init & live)] = 0
        o = lightning_decode_naive(qt, kt, vt, states, slopes_t)
        o[~live] = 0
        rows = torch.where(live[:, None], t_out.to(pools.torch_data.device), NULL_BLOCK)
        write_layer_states(pools, layer, rows, states, seeds)
        return from_torch(o, fw)
    from hybridkv.ops.lightning import kernel, kernel_quant

    dev = pools.torch_data.device
    if layer.stored is not None:
        o = torch.empty(b, layer.num_heads, layer.dv, dtype=vt.dtype, device=dev)
        kernel_quant.launch_decode(
            pools.torch_data.view(-1), t_in.to(dev, torch.int32).contiguous(), t_out.to(dev, torch.int32).contiguous(),
            init.to(torch.int8).contiguous(), _seeds(seeds, b, dev), qt.contiguous(), kt.contiguous(),
            vt.contiguous(), o, decay_factors(slopes_t, torch.float32).to(dev), quantized.geometry(pools, layer),
        )  # fmt: skip
        return from_torch(o, fw)
    itemsize = torch.empty(0, dtype=layer.dtype).element_size()
    lay = pools.layout
    pool = pools.torch_data.view(-1).view(layer.dtype)
    slot_elems = lay.num_segments * pools.num_blocks * lay.segment_bytes // itemsize
    o = torch.empty(b, layer.num_heads, layer.dv, dtype=vt.dtype, device=dev)
    cdt = torch.float64 if layer.dtype == torch.float64 else torch.float32
    kernel.launch_decode(
        pool,
        t_in.to(dev, torch.int32).contiguous(),
        t_out.to(dev, torch.int32).contiguous(),
        init.to(torch.int8).contiguous(),
        qt.contiguous(),
        kt.contiguous(),
        vt.contiguous(),
        o,
        decay_factors(slopes_t, cdt).to(dev),
        slot_base=layer.slot * slot_elems,
        component_base=layer.component_offset // itemsize,
        block_elems=lay.block_bytes // itemsize,
        segment_elems=lay.segment_bytes // itemsize,
        num_blocks=pools.num_blocks,
    )
    return from_torch(o, fw)


def lightning_prefill(
    pools: BlockPools,
    state_table: Any,
    group: int,
    slot: int,
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens: Any,
    has_initial_state: Any,
    slopes: Any,
    block_size: int = 64,
    component: str | None = None,
    state_dtype: torch.dtype | None = None,
    validate: bool | None = None,
    backend: Backend | str = "auto",
    exports: Sequence[tuple[int, int, Any]] = (),
    seeds: Any = None,
) -> Any:
    """Chunked prefill of ``B`` packed rows through the paged state, block-wise (Lightning Attention-2).

    ``q``, ``k`` ``[T, H, d_k]``, ``v`` ``[T, H, d_v]`` packed by ``cu_seqlens`` (int ``[B + 1]``);
    ``state_table`` as in :func:`lightning_decode` (read, then written: the state after each row's last
    token); ``has_initial_state`` bool ``[B]``: False starts from zeros (the set's old bytes are ignored).
    Null rows and rows of length 0 write nothing (their outputs are zero). Returns ``o`` ``[T, H, d_v]``.
    Triton (CUDA, or ``backend="triton"`` under the interpreter): one launch, each (row, head, value
    tile) reads its state in place, runs the row's tokens in blocks of ``block_size`` (rounded up to a
    power of two >= 16) and writes the state back. Reference: gather the rows' states with the
    addressing rule -> :func:`~.naive.lightning_prefill_varlen_naive` -> write back. See
    ``docs/ops.md`` for why flash-linear-attention's chunk kernel is not used.

    ``exports``: ``(row, tokens, sets)`` triples: the state after the row's first ``tokens`` tokens
    (``0 < tokens <`` the row's length) is also written into ``sets``, state sets ``[G, bps]`` as in a
    ``StepPlan.exports`` entry (``tokens`` is its position less the row's computed tokens), other than
    any set the table writes. The row runs in pieces split there, one launch per piece (both backends).

    A quantized component: as :func:`lightning_decode` (each program owns a whole head there);
    ``seeds`` int64 ``[B]`` round every write of a row, an export's state included.
    """
    if len(exports):
        return _prefill_exporting(
            pools, state_table, group, slot, q, k, v, cu_seqlens, has_initial_state, slopes, block_size,
            component, state_dtype, validate, backend, exports, seeds,
        )
    pools.require_slot_major("lightning_prefill")
    layer = lightning_layer(pools, group, slot, component, state_dtype)
    fw = _framework_of(v)
    qt, kt, vt = to_torch(q), to_torch(k), to_torch(v)
    cu = to_torch(cu_seqlens).to(torch.int64).cpu()
    table = _table(state_table, group).to(pools.torch_data.device, torch.int64)
    b = cu.numel() - 1
    if table.shape[0] != b:
        raise ValueError(f"state table has {table.shape[0]} rows, cu_seqlens {b}")
    if validate or (validate is None and to_torch(state_table).device.type == "cpu"):
        _check_distinct_outputs(table, pools.layout.blocks_per_state[group])
    if (
        qt.shape[1:] != (layer.num_heads, layer.dk)
        or kt.shape != qt.shape
        or vt.shape[1:] != (layer.num_heads, layer.dv)
    ):
        raise ValueError(f"q, k, v {tuple(qt.shape)}, {tuple(kt.shape)}, {tuple(vt.shape)} do not match the state")
    lengths = (cu[1:] - cu[:-1]).to(pools.torch_data.device)
    live = _live_rows(table) & (lengths > 0)
    init = to_torch(has_initial_state).to(pools.torch_data.device, torch.bool) & live
    if resolve_backend(backend, pools.torch_data.device) is Backend.NAIVE:
        states = read_layer_states(pools, layer, table)
        o = lightning_prefill_varlen_naive(qt, kt, vt, cu, states, init.cpu(), to_torch(slopes), block_size)
        o[torch.repeat_interleave(~live.cpu(), cu[1:] - cu[:-1])] = 0
        write_layer_states(pools, layer, torch.where(live[:, None], table, NULL_BLOCK), states, seeds)
        return from_torch(o, fw)
    from hybridkv.ops.lightning import kernel, kernel_quant

    dev, lay = pools.torch_data.device, pools.layout
    if layer.stored is not None:
        o = torch.empty_like(vt, device=dev)
        kernel_quant.launch_prefill(
            pools.torch_data.view(-1), table.to(dev, torch.int32).contiguous(), init.to(torch.int8).contiguous(),
            _seeds(seeds, b, dev), cu.to(dev, torch.int32), qt.contiguous(), kt.contiguous(), vt.contiguous(), o,
            (-to_torch(slopes).to(torch.float64)).to(dev, torch.float32), quantized.geometry(pools, layer), block_size,
        )  # fmt: skip
        return from_torch(o, fw)
    itemsize = torch.empty(0, dtype=layer.dtype).element_size()
    o = torch.empty_like(vt, device=dev)
    cdt = torch.float64 if layer.dtype == torch.float64 else torch.float32
    kernel.launch_prefill(
        pools.torch_data.view(-1).view(layer.dtype),
        table.to(dev, torch.int32).contiguous(),
        init.to(torch.int8).contiguous(),
        cu.to(dev, torch.int32),
        qt.contiguous(),
        kt.contiguous(),
        vt.contiguous(),
        o,
        (-to_torch(slopes).to(torch.float64)).to(dev, cdt),
        slot_base=layer.slot * (lay.num_segments * pools.num_blocks * lay.segment_bytes // itemsize),
        component_base=layer.component_offset // itemsize,
        block_elems=lay.block_bytes // itemsize,
        segment_elems=lay.segment_bytes // itemsize,
        num_blocks=pools.num_blocks,
        block_tokens=block_size,
    )
    return from_torch(o, fw)


def _prefill_exporting(
    pools: BlockPools, state_table: Any, group: int, slot: int, q: Any, k: Any, v: Any, cu_seqlens: Any,
    has_initial_state: Any, slopes: Any, block_size: int, component: str | None, state_dtype: torch.dtype | None,
    validate: bool | None, backend: Backend | str, exports: Sequence[tuple[int, int, Any]], seeds: Any = None,
) -> Any:
    """:func:`lightning_prefill` with ``exports``: piece ``j`` of every row runs from its ``j``-th cut
    to the next (rows with fewer cuts run nothing), then each cut's state is copied from the row's
    live set into its export sets; the outputs are put back in token order."""
    fw = _framework_of(v)
    qt, kt, vt = to_torch(q), to_torch(k), to_torch(v)
    cu = to_torch(cu_seqlens).to(torch.int64).cpu()
    table = _table(state_table, group).to(torch.int64)
    b = cu.numel() - 1
    cuts: list[list[tuple[int, Any]]] = [[] for _ in range(b)]
    for row, tokens, sets in exports:
        row, tokens = int(row), int(tokens)
        if not 0 <= row < b or not 0 < tokens < int(cu[row + 1] - cu[row]):
            raise ValueError(f"export of row {row} after {tokens} tokens is not inside a row of {b}")
        cuts[row].append((tokens, to_torch(sets)[group].to(torch.int64)))
    for c in cuts:
        c.sort(key=lambda t: t[0])
        if len({t for t, _ in c}) != len(c):
            raise ValueError("two exports of one row at the same position")
    layer = lightning_layer(pools, group, slot, component, state_dtype)
    init = to_torch(has_initial_state).to(torch.bool).cpu().clone()
    o = torch.zeros_like(vt)
    for j in range(1 + max(len(c) for c in cuts)):
        index, lengths, done = [], [], []
        for r in range(b):
            ends = [0, *(t for t, _ in cuts[r]), int(cu[r + 1] - cu[r])]
            lo, hi = (ends[j], ends[j + 1]) if j + 1 < len(ends) else (0, 0)
            index.append(torch.arange(int(cu[r]) + lo, int(cu[r]) + hi))
            lengths.append(hi - lo)
            if j < len(cuts[r]):
                done.append((r, cuts[r][j][1]))
        idx = torch.cat(index)
        piece_cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int64)
        piece_init = init if j == 0 else torch.ones(b, dtype=torch.bool)
        o[idx] = lightning_prefill(
            pools, state_table, group, slot, qt[idx], kt[idx], vt[idx], piece_cu, piece_init, slopes, block_size,
            component, state_dtype, validate, backend, seeds=seeds,
        )
        if done:  # the stored bytes as they are (a quantized state's values and scales)
            rows = torch.tensor([r for r, _ in done], dtype=torch.int64)
            live = table[rows].to(pools.torch_data.device)
            quantized.copy_sets(pools, layer, live, torch.stack([sets for _, sets in done]).to(live.device))
    return from_torch(o, fw)


__all__ = [
    "LightningLayer",
    "decay_factors",
    "lightning_decode",
    "lightning_decode_naive",
    "lightning_layer",
    "lightning_prefill",
    "lightning_prefill_naive",
    "lightning_prefill_varlen_naive",
    "lightning_recurrent_naive",
    "lightning_slopes",
    "read_layer_states",
    "write_layer_states",
]
