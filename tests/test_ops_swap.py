"""swap_blocks: device <-> host pools, coalesced runs, plans from the block manager."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest
import torch

from hybridkv.ops import CompletedSwap, allocate_host_pools, allocate_pools, swap_blocks
from hybridkv.ops.swap.runs import host_runs, swap_runs
from hybridkv.ops.testing import fill_random_, small_layout


class Plan(NamedTuple):  # the shape of blockmgr's SwapPlan that swap_blocks relies on
    device_blocks: np.ndarray
    host_blocks: np.ndarray


class DirectedPlan(NamedTuple):
    device_blocks: list
    host_blocks: list
    direction: str


def _pools(seed=0):
    layout = small_layout()
    device = fill_random_(allocate_pools(layout, "cpu"), seed)
    host = fill_random_(allocate_host_pools(layout, 10, fill="nan"), seed + 1)
    return device, host


def test_host_runs_split_where_ids_stop_being_consecutive():
    assert host_runs(np.array([0, 1, 2, 5, 6, 9])) == [(0, 3), (3, 5), (5, 6)]
    assert host_runs(np.array([], dtype=np.int64)) == []


def test_one_host_copy_per_run_of_host_ids_whatever_the_device_order():
    device, host = _pools()
    dev_ids, host_ids = np.array([9, 2, 17, 5, 11]), np.array([3, 4, 5, 0, 1])
    assert swap_runs(device, host, dev_ids, host_ids, out=True, non_blocking=False) == 2
    for d, h in zip(dev_ids, host_ids, strict=True):
        assert torch.equal(host.torch_data[h], device.torch_data[:, :, d])
    # a staging buffer of one block at a time gives the same bytes
    device2, host2 = _pools()
    swap_runs(device2, host2, dev_ids, host_ids, out=True, non_blocking=False, max_staging_bytes=1)
    assert torch.equal(host2.torch_data, host.torch_data)


@pytest.mark.parametrize("backend", ["auto", "naive"])
def test_swap_out_then_in_restores_the_blocks(backend):
    device, host = _pools()
    before = device.torch_data.clone()
    dev_ids, host_ids = [5, 6, 7, 12, 3], [0, 1, 2, 9, 4]
    done = swap_blocks(device, host, dev_ids, host_ids, "out", backend=backend)
    assert isinstance(done, CompletedSwap) and done.query()
    done.synchronize()
    done.wait()
    for d, h in zip(dev_ids, host_ids, strict=True):
        assert torch.equal(host.torch_data[h], before[:, :, d])
    device.torch_data[:, :, 1:] = 0
    swap_blocks(device, host, [20, 21, 22, 23, 1], host_ids, "in", backend=backend)
    for d, s in zip([20, 21, 22, 23, 1], dev_ids, strict=True):
        assert torch.equal(device.torch_data[:, :, d], before[:, :, s])
    assert not device.torch_data[:, :, [2, 5, 19]].any(), "other device blocks untouched"


def test_coalesced_swap_matches_block_by_block_reference():
    (dev_a, host_a), (dev_b, host_b) = _pools(3), _pools(3)
    rng = np.random.default_rng(3)
    dev_ids = rng.permutation(np.arange(1, 24))[:10]
    host_ids = rng.permutation(10)
    swap_blocks(dev_a, host_a, dev_ids, host_ids, "out", backend="naive")
    swap_blocks(dev_b, host_b, dev_ids, host_ids, "out")
    assert torch.equal(host_a.torch_data, host_b.torch_data)
    swap_blocks(dev_a, host_a, np.arange(10, 20), host_ids, "in", backend="naive")
    swap_blocks(dev_b, host_b, np.arange(10, 20), host_ids, "in")
    assert torch.equal(dev_a.torch_data, dev_b.torch_data)


def test_swap_takes_a_plan_with_direction_fourth_or_inside():
    device, host = _pools()
    swap_blocks(device, host, Plan(np.array([4, 5]), np.array([8, 9])), "out")
    assert torch.equal(host.torch_data[8:10], device.torch_data[:, :, 4:6].permute(2, 0, 1, 3))
    swap_blocks(device, host, DirectedPlan([10, 11], [8, 9], "in"))
    assert torch.equal(device.torch_data[:, :, 10:12], device.torch_data[:, :, 4:6])
    swap_blocks(device, host, Plan(np.array([4]), np.array([3])), direction="out")
    assert torch.equal(host.torch_data[3], device.torch_data[:, :, 4])


@pytest.mark.parametrize(
    ("dev_ids", "host_ids", "direction", "message"),
    [
        ([1], [10], "out", "outside the pool's 0..9"),
        ([24], [1], "out", "outside the pool's 0..23"),
        ([0], [1], "in", "null block"),
        ([1, 2], [3, 3], "out", "appears twice"),
        ([1, 1], [3, 4], "in", "appears twice"),
        ([1], [2], "sideways", "'out'"),
        ([1], [2], None, "'out'"),
    ],
)
def test_swap_rejects(dev_ids, host_ids, direction, message):
    device, host = _pools()
    with pytest.raises(ValueError, match=message):
        swap_blocks(device, host, dev_ids, host_ids, direction)


def test_swap_rejects_pools_of_other_layouts():
    device, _ = _pools()
    other = allocate_host_pools(small_layout(block_size=8), 4)
    with pytest.raises(ValueError, match="one layout"):
        swap_blocks(device, other, [1], [1], "out")


def test_host_and_device_pools_are_not_interchangeable():
    from hybridkv.ops import copy_blocks

    device, host = _pools()
    with pytest.raises(ValueError, match="allocate_host_pools"):
        swap_blocks(device, device, [1], [2], "out")
    with pytest.raises(ValueError, match="not on a host pool"):
        swap_blocks(host, host, [1], [2], "out")
    with pytest.raises(ValueError, match="not on a host pool"):
        copy_blocks(host, [1], [2])


def test_manager_swap_plans_round_trip_kv_and_state():
    """blockmgr's SwapPlan drives the copies; after swap out, scribbling and swap in, every byte is back."""
    from hybridkv.blockmgr.manager import HybridBlockManager
    from hybridkv.ops import allocate_state_buffers, gather_states

    layout = small_layout()
    manager = HybridBlockManager(layout, num_host_blocks=9)
    device = fill_random_(allocate_pools(layout, "cpu"), seed=7)
    host = allocate_host_pools(layout, 9, fill="nan")  # the manager's host ids run 0..8
    manager.allocate("a", 6)

    def snapshot():
        states = gather_states(
            device, manager.state_table(["a"]), None, allocate_state_buffers(layout, 1, device="cpu")
        )
        kv = device.torch_data[:, :, manager.block_table(["a"])[0]]
        return states.torch_data.clone(), kv.clone()

    before = snapshot()
    plan = manager.swap_out("a")
    swap_blocks(device, host, plan).synchronize()  # the direction comes from the plan
    plan.commit()
    device.torch_data[:, :, 1:] = 0xAA
    plan = manager.swap_in("a")
    swap_blocks(device, host, plan, "in").wait()
    plan.commit()
    after = snapshot()
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])
    manager.check_integrity()
