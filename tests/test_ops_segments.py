"""The per-segment kernel (hybridkv.ops.segments) against the index-move reference, bit for bit.

FastDeploy's ``caches`` keep every segment in its own allocation; the kernel addresses them through a
device row of base pointers, one launch per layer. Runs under Triton's interpreter (torch CPU tensors);
the no-torch lane skips it (the interpreter is built on torch), and on a GPU the same entry points take
Paddle tensors.
"""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.integrations.fastdeploy.state import gather_state_bytes, scatter_state_bytes
from hybridkv.integrations.fastdeploy.worker import allocate_caches
from hybridkv.ops import segments as segment_ops
from hybridkv.ops.testing import INTERPRETER_SKIP, interpreter_enabled, small_layout

pytestmark = pytest.mark.skipif(not interpreter_enabled(), reason=INTERPRETER_SKIP)


def _caches(seed: int):
    import torch

    layout = small_layout()
    caches = allocate_caches(layout, framework="torch")
    gen = torch.Generator().manual_seed(seed)
    for segs in caches.segments:  # random bytes everywhere: a stray read or write shows
        for t in segs:
            t.copy_(torch.randint(0, 256, tuple(t.shape), generator=gen, dtype=torch.uint8))
    return layout, caches


def _tables(layout, group: int, rows: int, seed: int) -> np.ndarray:
    ids = np.random.default_rng(seed).permutation(np.arange(1, layout.num_blocks))
    width = layout.blocks_per_state[group]
    return ids[: rows * width].reshape(rows, width)


def _snapshot(caches) -> list[bytes]:
    return [t.numpy().tobytes() for segs in caches.segments for t in segs]


@pytest.mark.parametrize("trim", [0, 3, 200])
def test_gather_kernel_equals_the_index_moves(trim):
    layout, caches = _caches(0)
    assert layout.num_segments >= 2 and layout.block_bytes > layout.segment_bytes
    for slot in caches.layer_slots.values():
        nbytes = layout.model.layers[slot.layer_id].state_bytes - trim  # a partial last block, odd sizes
        tables = _tables(layout, slot.group, 3, slot.layer_id)
        want = gather_state_bytes(slot, layout, tables, nbytes, backend="naive")
        got = gather_state_bytes(slot, layout, tables, nbytes, backend="triton")
        assert got.shape == want.shape and bool((got == want).all())


@pytest.mark.parametrize("trim", [0, 5])
def test_scatter_kernel_writes_exactly_what_the_index_moves_write(trim):
    layout, a = _caches(1)
    _, b = _caches(1)
    for slot_a, slot_b in zip(a.layer_slots.values(), b.layer_slots.values(), strict=True):
        nbytes = layout.model.layers[slot_a.layer_id].state_bytes - trim
        tables = _tables(layout, slot_a.group, 4, 7 + slot_a.layer_id)
        data = np.random.default_rng(slot_a.layer_id).integers(0, 256, (4, nbytes), dtype=np.uint8)
        before = _snapshot(a)
        scatter_state_bytes(slot_a, layout, tables, data, backend="naive")
        scatter_state_bytes(slot_b, layout, tables, data, backend="triton")
        assert _snapshot(a) == _snapshot(b) != before
        got = gather_state_bytes(slot_b, layout, tables, nbytes, backend="triton")
        assert np.array_equal(got.numpy(), data)


def test_the_pointer_row_is_built_once_per_set_of_allocations():
    layout, caches = _caches(2)
    slot = next(iter(caches.layer_slots.values()))
    row = segment_ops.pointer_row(slot.segments)
    assert segment_ops.pointer_row(slot.segments) is row
    assert row.tolist() == [t.data_ptr() for t in slot.segments]
    with pytest.raises(ValueError, match="backend"):
        gather_state_bytes(slot, layout, _tables(layout, slot.group, 1, 0), 8, backend="cuda")
