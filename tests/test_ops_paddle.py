"""Paddle tensors through the same API: DLPack views, same kernels, the same bytes as torch.

The tests compare against numpy and run in the no-torch lane too (reference path); the Triton
parameters, which need Triton's interpreter (built on torch), skip there with a reason naming their
twin. The tests that take torch as the oracle are in tests/test_ops_paddle_vs_torch.py (torch lane)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from hybridkv.ops import (
    allocate_host_pools,
    allocate_pools,
    copy_blocks,
    swap_blocks,
)
from hybridkv.ops.testing import fill_random_, interpreter_enabled, small_layout

paddle = pytest.importorskip("paddle")
HAS_TORCH = importlib.util.find_spec("torch") is not None

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
