"""copy_blocks: whole blocks across every slot and segment; the kernel matches the reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.ops import allocate_pools, copy_blocks
from hybridkv.ops.testing import fill_random_, interpreter_enabled, small_layout

needs_interpreter = pytest.mark.skipif(
    not interpreter_enabled(), reason="Triton kernels run on CPU only in Triton's interpreter: set TRITON_INTERPRET=1"
)
LAYOUTS = {
    "two_segments": dict(),
    "one_segment_odd_bytes": dict(pattern="RR-R", state_block_bytes=9),
    "one_segment_big": dict(pattern="RRR", state_block_bytes=20_000),  # more than one 8 KiB tile per segment
}


def _pools(name, seed=0):
    return fill_random_(allocate_pools(small_layout(**LAYOUTS[name]), "cpu", fill="nan"), seed)


@pytest.mark.parametrize("name", LAYOUTS)
def test_reference_copies_every_slot_and_segment(name):
    pools = _pools(name)
    before = pools.torch_data.clone()
    copy_blocks(pools, [3, 7, 3], [10, 2, 11], backend="naive")  # block 3 forked twice
    after = pools.torch_data
    for s, d in [(3, 10), (7, 2), (3, 11)]:
        assert torch.equal(after[:, :, d], before[:, :, s])
    untouched = [b for b in range(pools.num_blocks) if b not in (10, 2, 11)]
    assert torch.equal(after[:, :, untouched], before[:, :, untouched])


@needs_interpreter
@pytest.mark.parametrize("name", LAYOUTS)
def test_triton_copy_blocks_matches_reference(name):
    want, got = _pools(name), _pools(name)
    src, dst = torch.tensor([5, 1, 9, 0]), torch.tensor([12, 4, 20, 6])  # copying the null block zeroes block 6
    copy_blocks(want, src, dst, backend="naive")
    copy_blocks(got, src, dst, backend="triton")
    assert torch.equal(got.torch_data, want.torch_data)
    assert not got.torch_data[:, :, 6].any()


def test_empty_copy_is_a_no_op():
    pools = _pools("two_segments")
    before = pools.torch_data.clone()
    copy_blocks(pools, [], [], backend="naive")
    assert torch.equal(pools.torch_data, before)


@pytest.mark.parametrize(
    ("src", "dst", "message"),
    [
        ([1, 2], [2, 3], "both a source and a destination"),
        ([1], [0], "null block"),
        ([1, 2], [5, 5], "appears twice"),
        ([1], [24], "outside the pool"),
        ([-1], [3], "outside the pool"),
        ([1, 2], [3], "2 source blocks but 1"),
        ([[1]], [[3]], "1-D"),
    ],
)
def test_copy_blocks_rejects(src, dst, message):
    with pytest.raises(ValueError, match=message):
        copy_blocks(_pools("two_segments"), src, dst)


def test_manager_fork_copies_give_the_child_the_parents_state():
    from hybridkv.blockmgr.manager import HybridBlockManager
    from hybridkv.ops import allocate_state_buffers, gather_states

    layout = small_layout()
    manager = HybridBlockManager(layout)
    pools = fill_random_(allocate_pools(layout, "cpu"), seed=3)
    manager.allocate("parent", 6)
    copies = manager.fork("parent", "child")
    assert len(copies) == sum(layout.blocks_per_state)
    copy_blocks(pools, copies)
    table = manager.state_table(["parent", "child"])
    out = gather_states(pools, table, None, allocate_state_buffers(layout, 2, device="cpu"))
    for r in out.regions:
        rows = out.region_bytes(r)
        assert torch.equal(rows[0], rows[1])
    with pytest.raises(ValueError, match="dst_blocks"):
        copy_blocks(pools, [1, 2])


@needs_interpreter
@settings(max_examples=15, deadline=None)
@given(data=st.data(), name=st.sampled_from(sorted(LAYOUTS)))
def test_triton_copy_blocks_matches_reference_on_random_pairs(data, name):
    want = _pools(name, seed=1)
    got = _pools(name, seed=1)
    ids = data.draw(st.permutations(range(1, want.num_blocks)))
    n = data.draw(st.integers(0, min(6, len(ids) // 2)))
    src = ids[:n] + data.draw(st.lists(st.sampled_from(ids[:n] or [0]), max_size=2))  # forks repeat a source
    dst = ids[n : n + len(src)]
    copy_blocks(want, src, dst, backend="naive")
    copy_blocks(got, src, dst, backend="triton")
    assert torch.equal(got.torch_data, want.torch_data)
