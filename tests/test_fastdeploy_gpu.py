"""GPU-only check (skipped without CUDA): each FastDeploy ``caches`` entry starts its CUDA IPC
allocation, which is what ``set_data_ipc`` hands to the cache-transfer process.

torch's ``UntypedStorage._share_cuda_()`` returns the IPC handle of the ``cudaMalloc`` block holding
a storage and the storage's byte offset in that block (4th field). A caching allocator may place a
tensor inside a larger block; then a receiver that opens the handle maps the block's start, not the
tensor. Also the layer kernels compiled for the device (not Triton's interpreter: the lightning
kernel's prefill chunks run fp32 ``tl.dot`` there) against the float64 reference, on CUDA caches.
Run on a GPU machine: ``python -m pytest tests/test_fastdeploy_gpu.py``. Not run here (no GPU).
"""

import os

import pytest

from tests.test_fastdeploy import minimax_layout

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "block_wise_fp8"])
def test_every_cache_tensor_is_at_offset_0_of_its_ipc_allocation(kv_dtype):
    from hybridkv.integrations.fastdeploy.worker import allocate_caches

    c = allocate_caches(minimax_layout(kv_dtype, num_blocks=512), framework="torch", device="cuda:0")
    for i, t in enumerate(c.caches):
        if t is None:
            continue
        shared = t.untyped_storage()._share_cuda_()
        offset_bytes = shared[3]
        assert offset_bytes == 0 and t.storage_offset() == 0, f"caches[{i}] sits {offset_bytes} B into its block"


@pytest.mark.parametrize("framework", ["torch", "paddle"])
@pytest.mark.parametrize("kind", ["lightning", "gdn"])
def test_the_layer_kernels_on_the_device_equal_the_reference(kind, framework):
    """tests/test_fastdeploy_kernels.py's long steps (prefills of several chunks, continued prefills,
    decode, a late join) on CUDA caches of ``framework``: outputs and states within its tolerance,
    every other byte equal."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("runs the compiled kernels: unset TRITON_INTERPRET")
    if framework == "paddle":
        paddle = pytest.importorskip("paddle")
        if not paddle.device.is_compiled_with_cuda():
            pytest.skip("Paddle without CUDA")
    from tests.test_fastdeploy_kernels import LONG_STEPS, TOLERANCE, run

    device = "cuda:0" if framework == "torch" else "gpu:0"
    assert run(kind, steps=LONG_STEPS, framework=framework, device=device) < TOLERANCE
