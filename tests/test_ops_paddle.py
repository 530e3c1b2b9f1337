"""Paddle tensors through the same API: DLPack views, same kernels, the same bytes as torch.

The tests of copies and swaps compare against numpy and run in the no-torch lane too (reference
path); the tests that take torch as the oracle, or Triton's interpreter (built on torch), skip there
with a reason naming their twin."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from hybridkv.ops import (
    allocate_host_pools,
    allocate_pools,
    allocate_state_buffers,
    copy_blocks,
    gather_states,
    kv_cache_views,
    scatter_states,
    swap_blocks,
)
from hybridkv.ops.testing import fill_random_, interpreter_enabled, random_state_table, small_layout

paddle = pytest.importorskip("paddle")
HAS_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(
    not HAS_TORCH, reason="torch is this test's oracle: its no-torch twin is in tests/test_ops_paddle_native.py"
)

BACKENDS = [
    "naive",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            not (interpreter_enabled() and HAS_TORCH),
            reason="Triton kernels run on CPU only in Triton's interpreter (TRITON_INTERPRET=1, torch lane); "
            "the naive parameter of the same test is its twin in the no-torch lane",
        ),
    ),
]


def _paddle_pools(seed=0):
    """Paddle pools of random bytes and the same bytes in numpy (the oracle)."""
    layout = small_layout()
    p = fill_random_(allocate_pools(layout, "cpu", framework="paddle", fill="nan"), seed)
    return layout, p, p.data.numpy().copy()


def _twins(seed=0):
    """The same pool contents once in torch and once in paddle memory."""

    layout = small_layout()
    t = fill_random_(allocate_pools(layout, "cpu", fill="nan"), seed)
    p = allocate_pools(layout, "cpu", framework="paddle", fill="nan")
    p.torch_data.copy_(t.torch_data)
    return layout, t, p


@needs_torch
def test_paddle_pools_are_paddle_tensors_with_a_torch_alias():
    import torch

    layout, _, p = _twins()
    assert isinstance(p.data, paddle.Tensor) and tuple(p.data.shape) == tuple(p.torch_data.shape)
    assert p.torch_data.data_ptr() == p.data.data_ptr()
    caches = kv_cache_views(p)
    assert all(isinstance(c, paddle.Tensor) and c.dtype == paddle.bfloat16 for c in caches)
    assert tuple(caches[0].shape) == (layout.num_blocks, 2, 4, 8)
    p.torch_data[0, 0, 3, :2] = torch.tensor([0x80, 0x3F], dtype=torch.uint8)  # bf16 1.0
    assert caches[0][3, 0, 0, 0].astype("float32").item() == 1.0
    bufs = allocate_state_buffers(layout, 2, device="cpu", framework="paddle")
    ssm = bufs.layer(0, 0)["ssm"]
    assert isinstance(ssm, paddle.Tensor) and ssm.dtype == paddle.float32 and tuple(ssm.shape) == (2, 3, 5, 7)


@needs_torch
@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_and_scatter_on_paddle_tensors_give_torch_bytes(backend):
    import torch

    layout, t, p = _twins()
    table = random_state_table(layout, 3, seed=0, null_rows=(2,))
    out_t = allocate_state_buffers(layout, 3, device="cpu", fill="nan")
    out_p = allocate_state_buffers(layout, 3, device="cpu", framework="paddle", fill="nan")
    gather_states(t, table, None, out_t, backend=backend)
    gather_states(p, paddle.to_tensor(table), None, out_p, backend=backend)
    assert np.array_equal(out_p.data.numpy(), out_t.torch_data.numpy())
    src_np = np.random.default_rng(1).integers(0, 256, size=out_t.torch_data.numel(), dtype=np.uint8)
    out_t.torch_data.copy_(torch.from_numpy(src_np))
    out_p.data.copy_(paddle.to_tensor(src_np), False)
    scatter_states(t, table, None, out_t, backend=backend)
    scatter_states(p, paddle.to_tensor(table), None, out_p, backend=backend)
    assert np.array_equal(p.data.numpy(), t.torch_data.numpy())


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_blocks_on_paddle_pools(backend):
    _, p, want = _paddle_pools()
    copy_blocks(p, paddle.to_tensor([1, 2]), paddle.to_tensor([7, 8]), backend=backend)
    want[:, :, [7, 8]] = want[:, :, [1, 2]]
    assert np.array_equal(p.data.numpy(), want)


def test_swap_with_paddle_pools():
    layout, p, want = _paddle_pools()
    host_p = allocate_host_pools(layout, 4, framework="paddle")
    swap_blocks(p, host_p, [3, 4, 9], [0, 1, 2], "out").synchronize()
    assert isinstance(host_p.data, paddle.Tensor)
    assert np.array_equal(host_p.data.numpy()[:3], want[:, :, [3, 4, 9]].transpose(2, 0, 1, 3))
    p.data[:, :, 3:5] = 0
    swap_blocks(p, host_p, [3, 4], [1, 0], "in")
    assert np.array_equal(p.data.numpy()[:, :, 3], want[:, :, 4])
    assert np.array_equal(p.data.numpy()[:, :, 4], want[:, :, 3])
