"""FastDeploy's GDN staging (:class:`HybridGDNStatePool`) over an int8 / fp8 ``ssm`` state: the staging
holds float32, the gather dequantizes the set's values and float32 scales, the write-back quantizes
per row scale (to nearest) into the same bytes ``hybridkv.ops.states`` reads; conv stays as it is.
Torch CPU tensors in the torch lane, Paddle CPU tensors in the no-torch lane."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.integrations.fastdeploy import tensors as tensors_
from hybridkv.integrations.fastdeploy.gdn import HybridGDNStatePool
from hybridkv.integrations.fastdeploy.state import read_state_bytes, write_state_bytes
from hybridkv.integrations.fastdeploy.worker import StateTables, allocate_caches
from hybridkv.models.presets import gdn_layer, layers_from_pattern
from hybridkv.models.spec import AttentionLayerSpec, DType, ModelSpec
from hybridkv.ops.states import quant_np
from hybridkv.planner.layout import plan

FW = "torch" if importlib.util.find_spec("torch") is not None else "paddle"


def _layout(ssm_dtype: str):
    rec = gdn_layer(1, 2, 4, 4, 4, ssm_dtype, DType.BFLOAT16)  # ssm [2, 4, 4] + 8 row scales, conv [16, 3] bf16
    spec = ModelSpec("mini-gdn", layers_from_pattern("RRA", AttentionLayerSpec(1, 8, DType.BFLOAT16), rec))
    probe = plan(spec, 1 << 20, block_size=4)
    return plan(spec, 30 * probe.bytes_per_block, block_size=4)


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_the_gdn_staging_dequantizes_and_writes_back_quantized(dtype):
    layout = _layout(dtype)
    caches = allocate_caches(layout, framework=FW)
    tables = StateTables(layout, 3, framework=FW)
    manager = HybridBlockManager(layout)
    gdn = HybridGDNStatePool(caches, tables)
    spec = layout.model.layers[gdn.gdn_layer_ids[1]]
    ssm, conv = spec.component("ssm"), spec.component("conv")
    at = spec.component_offsets()
    assert str(gdn.ssm_staging.dtype).endswith("float32") and ssm.scale_count == 8
    rng = np.random.default_rng(0)
    stored = {}
    for idx, rid in ((0, "a"), (2, "b")):
        manager.allocate(rid, 4)
        sets = manager.state_table([rid])[:, 0]
        tables.set_row(idx, [row.tolist() for row in sets], rid)
        raw = rng.integers(0, 256, spec.state_bytes, dtype=np.uint8)
        raw[at["ssm"] : at["ssm"] + ssm.nbytes] = quant_np.encode(rng.standard_normal((1, ssm.numel)), ssm.dtype, 4)[0]
        slot = caches.layer_slots[gdn.gdn_layer_ids[1]]
        write_state_bytes(slot, layout, sets[slot.group].tolist(), raw)
        stored[idx] = (sets[slot.group].tolist(), raw)
    gdn.begin_forward([True, False, True])
    staged = gdn.get_layer_ssm_pool(1)
    for idx, (_, raw) in stored.items():
        want = quant_np.decode(raw[None, at["ssm"] : at["ssm"] + ssm.nbytes], ssm.dtype, ssm.numel, 4)
        assert np.array_equal(tensors_.to_numpy(staged[idx + 1]).reshape(1, -1), want)
    assert not tensors_.to_numpy(staged[0]).any() and not tensors_.to_numpy(staged[2]).any()
    new = rng.standard_normal(tuple(int(d) for d in staged.shape)).astype(np.float32) * 3
    staged[...] = tensors_.to_like(new, staged)
    gdn.end_forward()
    for idx, (blocks, raw) in stored.items():
        got = read_state_bytes(caches.layer_slots[gdn.gdn_layer_ids[1]], layout, blocks, spec.state_bytes)
        want = quant_np.encode(new[idx + 1].reshape(1, -1), ssm.dtype, 4)[0]
        assert np.array_equal(got[at["ssm"] : at["ssm"] + ssm.nbytes], want)  # values and their new scales
        assert np.array_equal(got[at["conv"] : at["conv"] + conv.nbytes], raw[at["conv"] : at["conv"] + conv.nbytes])
