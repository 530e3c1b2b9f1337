"""The ops on Paddle pools with Paddle alone, checked against the layout's rule read literally in numpy.

These run in both CI lanes: the torch lane and the no-torch lane (paddlepaddle + triton, no torch).
The kernels' twins, launched through the same Paddle-facing entry points, are in
``tests/test_ops_paddle.py`` (they need Triton's interpreter, which is built on torch).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from hybridkv.ops import (
    allocate_host_pools,
    allocate_pools,
    allocate_state_buffers,
    copy_blocks,
    gather_states,
    kv_cache_views,
    read_state,
    scatter_states,
    swap_blocks,
)
from hybridkv.ops.testing import fill_random_, random_state_table, small_layout
from hybridkv.planner.layout import NULL_BLOCK

paddle = pytest.importorskip("paddle")


def _pools(seed: int = 0):
    layout = small_layout()
    return layout, fill_random_(allocate_pools(layout, "cpu", framework="paddle", fill="nan"), seed)


def _state_bytes(pool: np.ndarray, layout, group: int, slot: int, row: np.ndarray) -> np.ndarray:
    """One state's flat bytes, block by block, each block's segments back to back; null blocks zero."""
    spec = layout.state_layer(group, slot)[1]
    pieces = []
    for block in row[: layout.blocks_per_state[group]]:
        seg = pool[slot, :, block].reshape(-1)
        pieces.append(np.zeros_like(seg) if block == NULL_BLOCK else seg)
    return np.concatenate(pieces)[: spec.state_bytes]


def test_pools_and_views_are_paddle_memory():
    layout, p = _pools()
    assert isinstance(p.data, paddle.Tensor) and p.device.type == "cpu" and p.num_blocks == layout.num_blocks
    assert not p.data.numpy()[:, :, NULL_BLOCK].any()
    k = kv_cache_views(p)[0]
    assert k.dtype == paddle.bfloat16 and tuple(k.shape) == (layout.num_blocks, 2, 4, 8)
    p.data[0, 0, 3, :2] = paddle.to_tensor([0x80, 0x3F], dtype="uint8")  # bf16 1.0 in K of block 3
    assert k[3, 0, 0, 0].astype("float32").item() == 1.0
    bufs = allocate_state_buffers(layout, 2, device="cpu", framework="paddle")
    ssm = bufs.layer(0, 0)["ssm"]
    assert ssm.dtype == paddle.float32 and tuple(ssm.shape) == (2, 3, 5, 7)
    bufs.data[:] = 0
    ssm[1, 0, 0, 0] = 2.5
    offset = bufs.regions[0].buffer_offset + bufs.regions[0].nbytes
    assert bufs.data.numpy()[offset : offset + 4].view(np.float32)[0] == 2.5


def test_gather_and_scatter_follow_the_layout_rule():
    layout, p = _pools()
    table = random_state_table(layout, 3, seed=1, null_rows=(2,))
    out = allocate_state_buffers(layout, 4, device="cpu", framework="paddle", fill="nan")
    gather_states(p, table, None, out, backend="naive")
    pool, got = p.data.numpy(), out.data.numpy()
    for r in out.regions:
        for b in range(3):
            want = _state_bytes(pool, layout, r.group, r.slot, table[r.group, b])[r.state_offset :][: r.nbytes]
            start = r.buffer_offset + b * r.nbytes
            assert np.array_equal(got[start : start + r.nbytes], want), (r, b)
        row3 = got[r.buffer_offset + 3 * r.nbytes : r.buffer_offset + 4 * r.nbytes]
        assert (row3 == 0xFF).all()  # rows past the table stay as they were
    assert not got[out.regions[0].buffer_offset + 2 * out.regions[0].nbytes :][: out.regions[0].nbytes].any()
    # scatter: new bytes land exactly in the table's state bytes, nothing else changes
    before = p.data.numpy().copy()
    noise = np.random.default_rng(2).integers(0, 256, size=out.data.shape, dtype=np.uint8)
    out.data[:] = paddle.to_tensor(noise)
    scatter_states(p, paddle.to_tensor(table), None, out, backend="naive")
    after = p.data.numpy()
    expect = before.copy()
    for r in out.regions:
        for b in range(2):  # row 2 is a null row: nothing written
            spec = layout.state_layer(r.group, r.slot)[1]
            flat = np.concatenate(
                [expect[r.slot, :, blk].reshape(-1) for blk in table[r.group, b, : layout.blocks_per_state[r.group]]]
            )
            flat[r.state_offset : r.state_offset + r.nbytes] = noise[r.buffer_offset + b * r.nbytes :][: r.nbytes]
            assert spec.state_bytes <= flat.size
            for j, blk in enumerate(table[r.group, b, : layout.blocks_per_state[r.group]]):
                expect[r.slot, :, blk] = flat[j * layout.block_bytes : (j + 1) * layout.block_bytes].reshape(
                    layout.num_segments, layout.segment_bytes
                )
    assert np.array_equal(after, expect)
    assert not after[:, :, NULL_BLOCK].any()


def test_copy_blocks_and_read_state():
    layout, p = _pools(3)
    before = p.data.numpy().copy()
    copy_blocks(p, [1, 2, 2], [7, 8, 9], backend="naive")
    expect = before.copy()
    expect[:, :, [7, 8, 9]] = before[:, :, [1, 2, 2]]
    assert np.array_equal(p.data.numpy(), expect)
    with pytest.raises(ValueError, match="null block"):
        copy_blocks(p, paddle.to_tensor([3]), paddle.to_tensor([0]))
    row = [5, NULL_BLOCK, 6][: layout.blocks_per_state[0]]
    state = read_state(p, 0, 0, row)
    flat = _state_bytes(p.data.numpy(), layout, 0, 0, np.array(row))
    assert state["ssm"].dtype == paddle.float32 and tuple(state["ssm"].shape) == (3, 5, 7)
    assert np.array_equal(state["ssm"].numpy().view(np.uint8).reshape(-1), flat[: 3 * 5 * 7 * 4])


def test_swap_out_and_in_through_a_paddle_host_pool():
    layout, p = _pools(4)
    host = allocate_host_pools(layout, 5, framework="paddle", pin_memory=False)
    assert isinstance(host.data, paddle.Tensor)
    before = p.data.numpy().copy()
    swap_blocks(p, host, [3, 4, 9], [2, 0, 1], "out").synchronize()
    h = host.data.numpy()
    for d, k in ((3, 2), (4, 0), (9, 1)):
        assert np.array_equal(h[k], before[:, :, d])
    p.data[:, :, 3:5] = 0
    swap_blocks(p, host, [4, 3], [2, 0], "in")
    got = p.data.numpy()
    assert np.array_equal(got[:, :, 4], before[:, :, 3]) and np.array_equal(got[:, :, 3], before[:, :, 4])


def test_nothing_on_the_paddle_path_imports_torch():
    """Run the Paddle path in a fresh interpreter where ``import torch`` fails: the ops, the FastDeploy
    worker pieces and their calls must not need it (Paddle itself treats torch as optional)."""
    code = textwrap.dedent(
        """
        import sys

        class NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is blocked in this test")
                return None

        sys.meta_path.insert(0, NoTorch())
        import numpy as np
        import paddle
        import hybridkv.ops
        from hybridkv.ops import allocate_pools, allocate_state_buffers, copy_blocks, gather_states, scatter_states
        from hybridkv.ops.testing import random_state_table, small_layout
        from hybridkv.integrations.fastdeploy import worker, state, gdn

        layout = small_layout()
        p = allocate_pools(layout, "cpu", framework="paddle", fill="nan")
        out = allocate_state_buffers(layout, 2, device="cpu", framework="paddle")
        table = random_state_table(layout, 2, seed=0)
        gather_states(p, table, None, out)
        scatter_states(p, table, None, out)
        copy_blocks(p, [1], [2])
        assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
        print("no torch")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "no torch" in done.stdout, done.stderr[-3000:]
