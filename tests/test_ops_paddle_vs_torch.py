"""Paddle pools against torch pools (torch lane only: torch is the oracle here). The no-torch twins,
against numpy, are tests/test_ops_paddle_native.py's ``test_pools_and_views_are_paddle_memory`` and
``test_gather_and_scatter_follow_the_layout_rule``."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.ops import allocate_pools, allocate_state_buffers, gather_states, kv_cache_views, scatter_states
from hybridkv.ops.testing import fill_random_, random_state_table, small_layout
from tests.test_ops_paddle import BACKENDS

paddle = pytest.importorskip("paddle")
torch = pytest.importorskip("torch")


def _twins(seed=0):
    """The same pool contents once in torch and once in paddle memory."""

    layout = small_layout()
    t = fill_random_(allocate_pools(layout, "cpu", fill="nan"), seed)
    p = allocate_pools(layout, "cpu", framework="paddle", fill="nan")
    p.torch_data.copy_(t.torch_data)
    return layout, t, p


def test_paddle_pools_are_paddle_tensors_with_a_torch_alias():
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_and_scatter_on_paddle_tensors_give_torch_bytes(backend):
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
