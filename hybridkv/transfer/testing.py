"""Test helpers of the transfer room: miniature models, seeded pools, and a reference reader of a
request's bytes that follows the layout's addressing rule, not the descriptors it checks."""

from __future__ import annotations

import numpy as np

from hybridkv.blockmgr.layout import Layout, plan
from hybridkv.blockmgr.presets import layers_from_pattern, lightning_layer, mamba2_layer
from hybridkv.blockmgr.spec import AttentionLayerSpec, DType, ModelSpec, RecurrentLayerSpec
from hybridkv.blockmgr.transfer_plans import RequestBlocks
from hybridkv.transfer.loopback import pool_array


def mini_minimax() -> ModelSpec:
    """MiniMax-M1 in miniature: 2 x (7 lightning + 1 attention); lightning state 512 B (fp32 kv [2, 8, 8])."""
    return ModelSpec(
        "mini-minimax",
        layers_from_pattern("RRRRRRRA" * 2, AttentionLayerSpec(1, 8, DType.BFLOAT16), lightning_layer(2, 8)),
    )


def mini_mamba2() -> ModelSpec:
    """A two-component state model: 2 attention + 4 Mamba2 layers (ssm 64 B + conv 96 B = 160 B)."""
    m2 = mamba2_layer(num_heads=2, head_dim=4, d_state=4, n_groups=1, conv_kernel=4)
    return ModelSpec("mini-mamba2", layers_from_pattern("MMAMMA", AttentionLayerSpec(1, 8, DType.BFLOAT16), m2))


def mini_layout(model: ModelSpec, num_blocks: int, layout: str = "paged", block_size: int = 4) -> Layout:
    """``model`` planned into exactly ``num_blocks`` blocks (null block included)."""
    probe = plan(model, 1 << 30, block_size=block_size, layout=layout)
    return plan(model, num_blocks * probe.bytes_per_block, block_size=block_size, layout=layout)


def seeded_pool(layout: Layout, seed: int, num_blocks: int | None = None) -> np.ndarray:
    """A :func:`pool_array` of random bytes from ``seed`` (block 0 zero, as the null block is)."""
    pool = pool_array(layout, num_blocks)
    pool[...] = np.random.default_rng(seed).integers(0, 256, size=pool.shape, dtype=np.uint8)
    pool[:, :, 0] = 0
    return pool


def reference_bytes(pool: np.ndarray, layout: Layout, blocks: RequestBlocks) -> bytes:
    """The request's bytes read by the layout's rule: every KV layer's K and V of every KV block, then
    every state layer's flat state (byte ``o`` in block ``set[o // block_bytes]``, segment
    ``o % block_bytes // segment_bytes``), in layer-slot order."""
    out = []
    kv = layout.kv_group
    if kv is not None:
        for slot, layer_id in enumerate(kv.layer_ids):
            if layer_id is not None:
                out.append(pool[slot][:, blocks.kv_blocks].tobytes())
    seg_b, blk_b = layout.segment_bytes, layout.block_bytes
    for g, group in enumerate(layout.state_groups):
        ids = blocks.state_blocks[g]
        for slot, layer_id in enumerate(group.layer_ids):
            if layer_id is None:
                continue
            layer = layout.model.layers[layer_id]
            assert isinstance(layer, RecurrentLayerSpec)
            o = np.arange(layer.state_bytes)
            within = o % blk_b
            out.append(pool[slot][within // seg_b, ids[o // blk_b], within % seg_b].tobytes())
    return b"".join(out)
