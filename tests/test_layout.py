"""The planner: vLLM's padded block sizes, the paged MiniMax layout, and bytes that add up."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.errors import LayoutError
from hybridkv.models.presets import PRESET_NAMES, preset
from hybridkv.models.spec import (
    AttentionLayerSpec,
    DType,
    ModelSpec,
    NoCacheLayerSpec,
    RecurrentLayerSpec,
    StateComponent,
)
from hybridkv.planner.layout import GroupKind, LayoutKind, plan

KiB, GiB = 1024, 1024**3


def test_padded_reproduces_vllm_qwen3_next_544():
    layout = plan(preset("qwen3-next-80b-a3b", "bfloat16", 1), 80 * GiB, layout="padded")
    assert layout.block_size == 544
    assert layout.blocks_per_state == (1, 1, 1)
    assert layout.block_bytes == 544 * 2048  # one page >= one layer's 1,097,728-byte state
    assert layout.block_bytes >= 1_097_728


def test_padded_reproduces_vllm_minimax_512_and_1024_for_fp32():
    assert plan(preset("minimax-m1", "bfloat16", 8), 80 * GiB, layout="padded").block_size == 512
    assert plan(preset("minimax-m1", "float32", 8), 80 * GiB, layout="padded").block_size == 1024


def test_paged_minimax_tp8_fp32_64_token_blocks():
    layout = plan(preset("minimax-m1", "float32", 8), 80 * GiB, block_size=64)
    assert layout.kind is LayoutKind.PAGED
    assert layout.block_bytes == 32 * KiB
    assert layout.segment_bytes == 16 * KiB and layout.num_segments == 2
    assert layout.blocks_per_state == (16,) * 7
    assert layout.num_state_groups == 7
    assert layout.num_layer_slots == 10
    fp = layout.footprint(32 * 1024)
    assert fp.waste.state_tail_bytes == 0
    assert (fp.num_kv_blocks, fp.num_state_blocks) == (512, 112)
    kv = layout.kv_group
    assert kv is not None and kv.layer_ids == tuple(range(7, 80, 8))
    # slot i holds the i-th lightning layer of every state group
    assert layout.state_groups[3].layer_ids[0] == [i for i in range(80) if i % 8 != 7][30]
    assert any("divide one another" in n for n in layout.notes)


def test_paged_beats_padded_for_short_prompts():
    model = preset("qwen3-next-80b-a3b", "bfloat16", 1)
    paged, padded = plan(model, 80 * GiB), plan(model, 80 * GiB, layout="padded")
    assert paged.capacity(300).max_requests > padded.capacity(300).max_requests
    assert padded.footprint(300).waste.kv_tail_bytes > paged.footprint(300).waste.kv_tail_bytes


def test_padding_layers_are_counted_as_waste():
    attn = AttentionLayerSpec(2, 64, DType.BFLOAT16)
    rec = RecurrentLayerSpec("gla", (StateComponent("kv", (2, 64, 64), DType.FLOAT32),))
    model = ModelSpec("odd", (attn, rec, rec, rec, attn, rec))  # 2 attention, 4 recurrent -> 2 groups of 2
    layout = plan(model, GiB, block_size=16)
    assert layout.group_size == 2 and layout.num_state_groups == 2
    model3 = ModelSpec("odder", (attn, rec, rec, rec, attn))  # 3 recurrent -> one padding layer
    layout3 = plan(model3, GiB, block_size=16)
    assert layout3.state_groups[1].layer_ids == (3, None)
    assert layout3.footprint(16).waste.padding_layer_bytes == layout3.blocks_per_state[1] * layout3.block_bytes


def test_errors_are_clear():
    model = preset("minimax-m1", tp_size=8)
    with pytest.raises(LayoutError, match="raise the memory budget"):
        plan(model, 100 * KiB)
    with pytest.raises(LayoutError, match="block_size must be a positive"):
        plan(model, GiB, block_size=0)
    with pytest.raises(LayoutError, match="group_size"):
        plan(model, GiB, group_size=5)


@pytest.mark.parametrize("name", PRESET_NAMES)
@pytest.mark.parametrize("kind", ["paged", "padded"])
def test_every_preset_plans(name, kind):
    layout = plan(preset(name), 40 * GiB, layout=kind)
    cap = layout.capacity(8192)
    assert cap.max_requests > 0
    assert all(b >= 1 for b in layout.blocks_per_state)


# ---- property test -----------------------------------------------------------------------------
dtypes = st.sampled_from(list(DType))


@st.composite
def model_specs(draw):
    attn = AttentionLayerSpec(
        draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([32, 64, 80, 128])), draw(dtypes)
    )
    comps = [
        StateComponent(f"c{i}", tuple(draw(st.lists(st.integers(1, 96), min_size=1, max_size=3))), draw(dtypes))
        for i in range(draw(st.integers(1, 3)))
    ]
    rec = RecurrentLayerSpec("custom", tuple(comps))
    kinds = draw(st.lists(st.sampled_from("ARR-"), min_size=1, max_size=40))
    if not any(k == "R" for k in kinds):
        kinds.append("R")
    layers = [attn if k == "A" else rec if k == "R" else NoCacheLayerSpec() for k in kinds]
    return ModelSpec("random", tuple(layers))


@settings(max_examples=200, deadline=None)
@given(
    model=model_specs(),
    block_size=st.integers(1, 130),
    budget=st.integers(10**6, 10**9),
    context=st.integers(0, 50_000),
    kind=st.sampled_from(["paged", "padded"]),
)
def test_planner_bytes_add_up_and_groups_never_collide(model, block_size, budget, context, kind):
    try:
        layout = plan(model, budget, block_size=block_size, layout=kind)
    except LayoutError as e:
        assert "raise the memory budget" in str(e)
        return
    # the pool and the left-over budget make up the budget
    assert (
        layout.num_blocks * layout.block_bytes * layout.group_size + (layout.budget_bytes - layout.pool_bytes) == budget
    )
    assert 0 <= budget - layout.pool_bytes < layout.bytes_per_block
    # every cache-holding layer sits in exactly one (group, slot); no slot holds two layers of a group
    seen = [(g.index, s, l) for g in layout.groups for s, l in enumerate(g.layer_ids) if l is not None]
    layer_ids = [l for _, _, l in seen]
    assert sorted(layer_ids) == sorted(model.attention_layer_ids + model.recurrent_layer_ids)
    assert len({(g, s) for g, s, _ in seen}) == len(seen)
    for g in layout.groups:
        assert len(g.layer_ids) == layout.group_size
        kinds = {type(model.layers[l]) for l in g.layer_ids if l is not None}
        assert kinds == ({AttentionLayerSpec} if g.kind is GroupKind.KV else {RecurrentLayerSpec})
    # one request's allocation = its useful bytes + its waste, and state sets cover the state
    fp = layout.footprint(context)
    assert fp.num_blocks * layout.block_bytes * layout.group_size == fp.allocated_bytes
    assert fp.kv_bytes + fp.state_bytes + fp.waste.total_bytes == fp.allocated_bytes
    for g in layout.state_groups:
        for l in g.layer_ids:
            if l is not None:
                assert g.blocks_per_state * layout.block_bytes >= model.layers[l].state_bytes
    # at capacity: requests + free blocks + the null block = the pool
    cap = layout.capacity(context)
    used = cap.max_requests * fp.num_blocks + cap.free_blocks + 1
    assert used == layout.num_blocks
    assert cap.free_blocks < fp.num_blocks or fp.num_blocks == 0


def _two_state_sizes(with_attention: bool) -> ModelSpec:
    big = RecurrentLayerSpec("big", (StateComponent("s", (8, 64, 64), DType.FLOAT32),))  # 128 KiB
    small = RecurrentLayerSpec("small", (StateComponent("s", (8, 64, 4), DType.FLOAT32),))  # 8 KiB
    attn = AttentionLayerSpec(num_kv_heads=2, head_dim=64, dtype=DType.BFLOAT16)
    layers = [big, small, small] * 4  # 4 big and 8 small states, interleaved as a model lays them out
    return ModelSpec("two-sizes", (*(attn, attn, attn, attn)[: 4 if with_attention else 0], *layers))


@pytest.mark.parametrize("with_attention", [True, False])
def test_states_of_one_size_share_a_group(with_attention):
    # a group gives every slot its largest state's blocks: interleaved sizes in one group would give each
    # 8 KiB state the blocks of a 128 KiB one
    model = _two_state_sizes(with_attention)
    block = {} if with_attention else {"state_block_bytes": 8 * KiB}  # a big state spans 16 blocks, a small one 1
    layout = plan(model, 1 * GiB, **block)
    for g in layout.groups:
        if g.kind is GroupKind.STATE:
            assert len({model.layers[i].state_bytes for i in g.layer_ids if i is not None}) == 1, g
            size = next(model.layers[i].state_bytes for i in g.layer_ids if i is not None)
            assert g.blocks_per_state == -(-size // layout.block_bytes)  # its own size, not the largest's
    if not with_attention:  # one group of all 12 would give each small state a big one's bytes
        assert layout.group_size in (4, 8)
        one_group = plan(model, 1 * GiB, group_size=12, **block)  # every slot 16 blocks: 12 x 128 KiB a request
        assert layout.capacity(1).max_requests > 2.5 * one_group.capacity(1).max_requests  # (16 + 1 + 1) x 4 x 8 KiB
