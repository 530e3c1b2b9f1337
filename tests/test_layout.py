"""The planner: vLLM's padded block sizes, the paged MiniMax layout, and bytes that add up."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.errors import LayoutError, SpecError
from hybridkv.models.presets import PRESET_NAMES, preset
from hybridkv.models.spec import (
    AttentionLayerSpec,
    DType,
    ModelSpec,
    NoCacheLayerSpec,
    RecurrentLayerSpec,
    SideTensor,
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


kv_dtypes = st.sampled_from([d for d in DType if d is not DType.INT64])
sides = st.lists(
    st.builds(SideTensor, st.sampled_from(["keys", "positions"]), st.integers(1, 300), dtypes),
    max_size=2,
    unique_by=lambda t: t.name,
).map(tuple)


@st.composite
def model_specs(draw):
    heads, head_dim, kv_dtype = (
        draw(st.sampled_from([1, 2, 4, 8])),
        draw(st.sampled_from([32, 64, 80, 128])),
        draw(kv_dtypes),
    )
    v_dim = draw(st.sampled_from([None, None, 0, 16, 64]))  # MLA-like widths, K only
    attn = [AttentionLayerSpec(heads, head_dim, kv_dtype, v_head_dim=v_dim, side=draw(sides)) for _ in range(2)]

    def state() -> RecurrentLayerSpec:
        comps = [
            StateComponent(f"c{i}", tuple(draw(st.lists(st.integers(1, 96), min_size=1, max_size=3))), draw(dtypes))
            for i in range(draw(st.integers(1, 3)))
        ]
        return RecurrentLayerSpec("custom", tuple(comps))

    rec = [state(), state()]  # two state sizes: the state groups may be regrouped by size
    kinds = draw(st.lists(st.sampled_from("AaRS-"), min_size=1, max_size=40))
    if not any(k in "RS" for k in kinds):
        kinds.append("R")
    table = {"A": attn[0], "a": attn[1], "R": rec[0], "S": rec[1]}
    layers = [table[k] if k in table else NoCacheLayerSpec() for k in kinds]
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
    if kind == "paged":  # regrouped by size never takes more blocks than groups cut in size order
        sizes = sorted(r.state_bytes for _, r in layout.model.recurrent_layers())
        cut = [max(sizes[i : i + layout.group_size]) for i in range(0, len(sizes), layout.group_size)]
        assert layout.num_state_blocks_per_request <= sum(-(-b // layout.block_bytes) for b in cut)
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


# ---- per-token side tensors (DeepSeek-sparse indexer keys) and K-only attention (issue 27) ---------
def _indexed_model(tp: int = 1) -> ModelSpec:
    """GLM-5 Next's shape, tiny: NoPE MLA (K = 32-wide latent, no V), a packed indexer [33] bf16 on
    the first indexed layer (the second, "shared", keeps none), and two KDA-like states."""
    packed = SideTensor("indexer", 33, DType.BFLOAT16)
    full = AttentionLayerSpec(1, 32, DType.BFLOAT16, 4, v_head_dim=0, side=(packed,))
    shared = AttentionLayerSpec(1, 32, DType.BFLOAT16, 4, v_head_dim=0)
    rec = RecurrentLayerSpec("kda", (StateComponent("ssm", (4, 8, 8), DType.FLOAT32),))
    return ModelSpec("indexed", (rec, full, shared, rec)).shard(tp)


def test_side_tensors_count_in_kv_bytes_and_take_segments_after_v():
    model = _indexed_model()
    assert model.kv_bytes_per_token == 2 * 32 * 2 + 33 * 2  # two latents + one packed indexer
    layout = plan(model, 64 * 2**20, block_size=16)
    # 1-column segments (2 B per token): K 32, V 0, side 33
    assert (layout.key_segments, layout.value_segments, layout.side_segments) == (32, 0, 33)
    assert layout.num_segments == 65 and layout.segment_bytes == 16 * 2
    full = layout.model.layers[1]
    assert layout.side_segment_run(full) == (32, 33, {"indexer": 0})
    assert any(n.startswith("per-token side tensors (indexer [33] bfloat16") for n in layout.notes)
    for tokens in (1, 16, 100):
        fp = layout.footprint(tokens)
        kv_blocks = -(-tokens // 16)
        # the shared layer's slot leaves its side segments unused: 33 x 2 B per token slot
        assert fp.waste.side_slack_bytes == kv_blocks * 16 * 66
        assert fp.kv_bytes == tokens * model.kv_bytes_per_token
        assert fp.kv_bytes + fp.state_bytes + fp.waste.total_bytes == fp.allocated_bytes


def test_side_tensors_stay_whole_under_tensor_parallelism_and_pad_to_a_column():
    keys = SideTensor("indexer_keys", 16, DType.BFLOAT16)
    pos = SideTensor("positions", 3, DType.INT64)
    first = AttentionLayerSpec(2, 16, DType.BFLOAT16, 4, side=(keys, pos))
    other = AttentionLayerSpec(2, 16, DType.BFLOAT16, 4, side=(keys,))
    rec = RecurrentLayerSpec("gdn", (StateComponent("ssm", (4, 8, 16), DType.FLOAT32),))
    model = ModelSpec("qsa", (rec, first, rec, other))
    assert model.kv_bytes_per_token == 2 * (2 * 2 * 16 * 2) + (32 + 24) + 32
    tp2 = model.shard(2)  # K/V heads split, the one-head indexer and the positions replicated
    assert tp2.layers[1].side == first.side and tp2.kv_bytes_per_token == 2 * (2 * 16 * 2) + 56 + 32
    layout = plan(model, 64 * 2**20, block_size=16)
    # columns of 2 heads x 2 B = 4 B; side 56 B = 14 columns; widths gcd(16, 16, 14) = 2
    assert (layout.key_segments, layout.value_segments, layout.side_segments) == (8, 8, 7)
    assert layout.side_segment_run(layout.model.layers[1])[2] == {"indexer_keys": 0, "positions": 32}
    fp = layout.footprint(20)
    assert fp.waste.side_slack_bytes == 2 * 16 * 24  # the second layer keeps no positions
    assert fp.kv_bytes + fp.state_bytes + fp.waste.total_bytes == fp.allocated_bytes
    # a side run that is not a whole column (2 B against 4-B columns) is padded to one and counted
    odd = AttentionLayerSpec(2, 16, DType.BFLOAT16, side=(SideTensor("flag", 1, DType.BFLOAT16),))
    lay = plan(ModelSpec("odd", (odd, rec)), 64 * 2**20, block_size=16)
    assert lay.side_segments == 1 and lay.footprint(16).waste.side_slack_bytes == 16 * 2
    fp = lay.footprint(16)
    assert fp.kv_bytes + fp.state_bytes + fp.waste.total_bytes == fp.allocated_bytes


def test_side_tensors_do_not_change_layouts_without_them():
    for name in PRESET_NAMES:
        layout = plan(preset(name), 40 * GiB)
        assert layout.side_segments == 0 and layout.footprint(100).waste.side_slack_bytes == 0


def test_attention_layers_differing_beyond_side_tensors_are_refused():
    a = AttentionLayerSpec(1, 32, DType.BFLOAT16, side=(SideTensor("indexer", 8, DType.BFLOAT16),))
    b = AttentionLayerSpec(2, 32, DType.BFLOAT16)
    with pytest.raises(LayoutError, match="different KV shapes"):
        plan(ModelSpec("mixed", (a, b)), GiB)


def test_side_tensor_and_v_width_checks():
    with pytest.raises(SpecError, match="width of side tensor"):
        SideTensor("indexer", 0, DType.BFLOAT16)
    with pytest.raises(SpecError, match="v_head_dim"):
        AttentionLayerSpec(1, 32, v_head_dim=-1)
    with pytest.raises(SpecError, match="duplicate"):
        AttentionLayerSpec(1, 32, side=(SideTensor("a", 1, "bf16"), SideTensor("a", 2, "bf16")))
    assert AttentionLayerSpec(1, 32, v_head_dim=0).kv_bytes_per_token == 64  # K only
    with pytest.raises(SpecError):
        DType.parse("int64")  # never a KV or state dtype choice
    assert DType.parse("int64", integer=True).itemsize == 8


def test_a_manager_allocates_a_request_of_an_indexed_model():
    layout = plan(_indexed_model(), 64 * 2**20, block_size=16)
    manager = HybridBlockManager(layout)
    free = manager.num_available_blocks
    manager.allocate("a", 100)
    taken = free - manager.num_available_blocks
    assert taken == layout.footprint(100).num_blocks == 7 + sum(layout.blocks_per_state)
    table = manager.block_table("a")[0]
    assert len(table) == 7 and 0 not in table
    manager.free("a")
    assert manager.num_available_blocks == free


def test_an_indexed_layers_side_bytes_live_in_its_slot_after_v():
    torch = pytest.importorskip("torch", reason="pool allocation needs torch")
    from hybridkv.ops.pools import allocate_pools

    layout = plan(_indexed_model(), 2**20, block_size=16)
    pools = allocate_pools(layout, "cpu", fill=0)
    slot = pools.slot(layout.kv_group.layer_ids.index(1))
    assert tuple(slot.shape) == (65, layout.num_blocks, 32)
    first, n, offsets = layout.side_segment_run(layout.model.layers[1])
    # token 5 of block 3: the packed indexer's bytes are columns of 2 B in segments 32..64
    packed = torch.arange(66, dtype=torch.uint8)
    slot[first : first + n, 3, 5 * 2 : 6 * 2] = packed.view(n, 2)
    assert slot[first : first + n, 3].reshape(n, 16, 2)[:, 5].reshape(-1).tolist() == packed.tolist()
    assert int(slot[:first].sum()) == 0  # K untouched


def test_state_groups_do_not_pad_small_states_to_a_large_ones_blocks():
    # 2 attention layers (groups of 2 slots), 3 small states (1 block) and 2 large (5 blocks): cut in
    # size order every 2 layers, one group would pair a small state with a large one (1 + 5 + 5
    # blocks per request); grouped by size it is 1 + 1 + 5 (RecurrentGemma's RG-LRU states beside
    # its K/V windows: 162 blocks -> 83 at its default config)
    attn = AttentionLayerSpec(1, 8, DType.BFLOAT16)  # 32 B per token: 512-B blocks at 16 tokens
    small = RecurrentLayerSpec("lru", (StateComponent("lru", (100,), DType.FLOAT32),))
    large = RecurrentLayerSpec("window", (StateComponent("kv", (10, 128), DType.FLOAT16),))
    model = ModelSpec("mixed-states", (attn, small, large, small, attn, large, small))
    layout = plan(model, 2**20, block_size=16)
    assert sorted(layout.blocks_per_state) == [1, 1, 5]
    held = sorted(l for g in layout.state_groups for l in g.layer_ids if l is not None)
    assert held == list(model.recurrent_layer_ids)
    for g in layout.state_groups:  # no group mixes sizes here
        assert len({model.layers[l].state_bytes for l in g.layer_ids if l is not None}) == 1
    fp = layout.footprint(40)
    assert fp.num_state_blocks == 7 and fp.kv_bytes + fp.state_bytes + fp.waste.total_bytes == fp.allocated_bytes
    assert layout.state_tail_fraction < 0.2
    padded = plan(model, 2**20, block_size=16, layout="padded")  # one state per page: groups as before
    assert len(padded.state_groups) == 3
