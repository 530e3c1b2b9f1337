"""Small layouts for block manager tests, chosen so block ids are easy to reason about."""

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.models.spec import AttentionLayerSpec, DType, ModelSpec, RecurrentLayerSpec, StateComponent
from hybridkv.planner.layout import plan


def tiny_model(num_attention: int = 2, num_recurrent: int = 4, state_shape=(3, 8, 4)) -> ModelSpec:
    """2 attention layers (16 B/token/segment) + 4 recurrent layers of 384 B: 2 state groups, 3 blocks each."""
    attn = AttentionLayerSpec(1, 8, DType.BFLOAT16)
    rec = RecurrentLayerSpec("gla", (StateComponent("kv", state_shape, DType.FLOAT32),))
    layers = [attn] * num_attention + [rec] * num_recurrent
    return ModelSpec("tiny", tuple(layers))


def tiny_manager(num_blocks: int = 40, num_host_blocks: int = 20, watermark: float = 0.0) -> HybridBlockManager:
    """block_size 4, block_bytes 128 per slot, 2 slots: 256 B per block id; ``num_blocks`` includes the null block."""
    layout = plan(tiny_model(), num_blocks * 256, block_size=4)
    assert layout.num_blocks == num_blocks and layout.blocks_per_state == (3, 3)
    return HybridBlockManager(layout, num_host_blocks=num_host_blocks, watermark=watermark)
