"""branch_spaced: branch_last_aligned's kinds of positions, a minimum gap (derived from bytes) apart."""

import pytest

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.prefix import CheckpointPolicy, EvictionPolicy, PrefixCacheConfig
from hybridkv.blockmgr.prefix.placement_rules import spaced_grids, spaced_positions
from hybridkv.planner.layout import plan

from .manager_fixtures import tiny_model


def test_spaced_positions_keep_the_gap_shallowest_first():
    grids = (512, 8192)
    # branch 10,240, input 15,000: candidates 8,192 (coarse grid), 10,240 (branch), 14,848 (fine grid)
    assert spaced_positions(15000, 10240, 0, 64, grids, 0) == [8192, 10240, 14848]
    assert spaced_positions(15000, 10240, 0, 64, grids, 2048) == [8192, 10240, 14848]
    # gap 3,000: the branch point is too close above 8,192 and is dropped; 14,848 is far enough above 8,192
    assert spaced_positions(15000, 10240, 0, 64, grids, 3000) == [8192, 14848]
    # a checkpoint already on the chain at 9,216 (the hit): nothing within the gap above it
    assert spaced_positions(15000, 10240, 9216, 64, grids, 2048) == [14848]
    assert spaced_positions(15000, 10240, 9216, 64, grids, 0) == [10240, 14848]
    # shared nothing: the coarsest grid's point only; shorter than every grid: the block-aligned end
    assert spaced_positions(15000, 0, 0, 64, grids, 2048) == [8192]
    assert spaced_positions(300, 0, 0, 64, grids, 0) == [256]
    assert spaced_positions(300, 0, 0, 64, grids, 2048) == []


def test_spaced_positions_do_not_depend_on_the_block_size_on_its_grid():
    """Inputs and branch points on the 1,024 grid: the same positions at 64 and 1,024-token blocks."""
    for input_len in range(1024, 40000, 3072):
        for branch in (0, 1024, input_len // 2048 * 1024):
            for floor in (0, 1024):
                got = {bs: spaced_positions(input_len, branch, floor, bs, (1024, 8192), 1792) for bs in (64, 1024)}
                assert got[64] == got[1024]


def manager(min_gap=None, num_blocks=600):
    layout = plan(tiny_model(), num_blocks * 256, block_size=4)
    config = PrefixCacheConfig(
        CheckpointPolicy.BRANCH_SPACED, EvictionPolicy.LRU, spaced_align_tokens=(16, 64), min_gap_tokens=min_gap
    )
    return HybridBlockManager(layout, prefix_cache=config)


def run(m, rid, tokens):
    """Admit with the cache's hit, prefill in chunks ending where the policy wants a checkpoint,
    free; returns (cached tokens at admission, positions where a checkpoint was taken)."""
    hit = m.match_prefix(tokens)
    alloc = m.allocate(rid, min(len(tokens), hit + 4), token_ids=tokens)
    taken = []
    if m.checkpoint(rid).src.size:
        taken.append(m.requests[rid].num_tokens)
    while m.requests[rid].num_tokens < len(tokens):
        m.release_pins()
        stop = m.next_checkpoint_position(rid) or len(tokens)
        m.append(rid, stop - m.requests[rid].num_tokens)
        if m.checkpoint(rid).src.size:
            taken.append(m.requests[rid].num_tokens)
    m.release_pins()
    m.free(rid)
    m.check_integrity()
    return alloc.num_cached_tokens, taken


def test_manager_spaces_checkpoints_and_siblings_hit():
    a = list(range(1000, 1150))  # 150 tokens: grid points 144 (16) and 128 (64)
    b = a[:100] + list(range(5000, 5050))  # 150 tokens sharing 100 with A (branch 100)
    c = a[:100] + list(range(7000, 7030))
    dense, spaced = manager(min_gap=0), manager(min_gap=40)
    assert run(dense, "a", a) == (0, [128])  # shared nothing: the coarsest grid's point only
    assert run(spaced, "a", a) == (0, [128])
    # B: branch 100, grid points 128 and 144; A's checkpoint (128) is past the shared prefix
    assert run(dense, "b", b) == (0, [100, 128, 144])
    # spaced: 128 is only 28 above the branch point: not worth a checkpoint; 144 is 44 above it
    assert run(spaced, "b", b) == (0, [100, 144])
    # C, a third sibling, hits the branch point in both
    assert run(dense, "c", c)[0] == run(spaced, "c", c)[0] == 100
    # D repeats B whole: dense hits B's 144 (its last checkpoint below the input's last token), so does spaced
    d = b + [1]
    assert run(dense, "d", d)[0] == run(spaced, "d", d)[0] == 144
    # E repeats B up to 136: dense hits 128, spaced backs off to 100 (the price of the gap)
    e = b[:136] + list(range(9000, 9020))
    assert run(dense, "e", e)[0] == 128
    assert run(spaced, "e", e)[0] == 100


def test_config_checks_spaced_fields():
    assert PrefixCacheConfig(spaced_align_tokens=512).spaced_align_tokens == (512,)
    for bad in ({"spaced_align_tokens": ()}, {"min_gap_tokens": -1}, {"gap_fraction": -0.5}):
        with pytest.raises(ValueError):
            PrefixCacheConfig(**bad)


def test_defaults_derive_from_a_checkpoints_bytes_in_kv_tokens():
    m = HybridBlockManager(plan(tiny_model(), 400 * 256, block_size=4), prefix_cache=PrefixCacheConfig())
    model, cache = m.layout.model, m.prefix_cache
    assert cache.config.checkpoint is CheckpointPolicy.BRANCH_SPACED
    assert cache.checkpoint_tokens == model.state_bytes / model.kv_bytes_per_token == 24
    assert cache.min_gap == 6 and cache.spaced_grids == (512, 512)
    # with a host tier the bytes weigh against device and host blocks together: 399 usable + 1197
    # host blocks, a quarter of the gap
    tiered = HybridBlockManager(plan(tiny_model(), 400 * 256, block_size=4), num_host_blocks=1197,
                                prefix_cache=PrefixCacheConfig(host_tier=True))
    assert tiered.pool.num_usable == 399 and tiered.prefix_cache.min_gap == int(6 * 399 / 1596) == 1
    fixed = PrefixCacheConfig(host_tier=True, min_gap_tokens=5)  # an explicit gap stays as given
    assert HybridBlockManager(plan(tiny_model(), 400 * 256, block_size=4), num_host_blocks=1197,
                              prefix_cache=fixed).prefix_cache.min_gap == 5
    # MiniMax-M1 TP8 fp32 and Qwen3-Next TP2: 7,168 and 1,608 tokens of KV per checkpoint
    assert spaced_grids(7168) == (512, 8192) and spaced_grids(1608) == (512, 2048)
    assert spaced_grids(8192) == (512, 8192) and spaced_grids(8193) == (512, 16384) and spaced_grids(3) == (512, 512)


@pytest.mark.parametrize("demote", [True, False])
def test_released_kv_past_the_deepest_checkpoint_is_evicted_first(demote):
    """demote_tail: a finished request's cached KV past the deepest checkpoint on its chain can end
    no hit (a hybrid model's hit needs a checkpoint), so it goes before everything older."""
    layout = plan(tiny_model(), 80 * 256, block_size=4)
    config = PrefixCacheConfig(CheckpointPolicy.EVERY_N_BLOCKS, EvictionPolicy.LRU, every_n=2, demote_tail=demote)
    m = HybridBlockManager(layout, prefix_cache=config)
    y = list(range(500, 517))  # 4 full blocks: checkpoints at 8 and 16, nothing past them
    x = list(range(600, 621))  # 5 full blocks: checkpoints at 8 and 16, the block ending at 20 past them
    for rid, tokens in (("y", y), ("x", x)):
        m.allocate(rid, 4, token_ids=tokens)
        while m.requests[rid].num_tokens < len(tokens):
            m.append(rid, min(4, len(tokens) - m.requests[rid].num_tokens))
            m.checkpoint(rid)
            m.release_pins()
        if rid == "x":
            x_tail = int(m.block_table(["x"])[0][4])
        m.free(rid)
    m.check_integrity()
    freed = m.prefix_cache.evict(1)
    m.pool.free(freed)
    assert (freed.tolist() == [x_tail]) is demote  # without demote_tail: the oldest unit (y's checkpoint)
    m.check_integrity()
    assert m.match_prefix(x + [1]) == 16 and m.match_prefix(y + [1]) == 16  # every hit survives


def test_next_checkpoint_position_from_an_engines_own_count():
    """An engine that counts computed tokens itself (FastDeploy's ``num_computed_tokens``) asks from
    its count; without one the manager's count is used; the answer is the policy's next position."""
    m = manager(min_gap=0)
    a = list(range(1000, 1150))
    run(m, "a", a)
    b = a[:100] + list(range(5000, 5050))  # branch 100, grid points 128 and 144
    m.allocate("b", 4, token_ids=b)
    assert m.next_checkpoint_position("b") == m.next_checkpoint_position("b", 4) == 100
    assert m.next_checkpoint_position("b", 100) == 128
    assert m.next_checkpoint_position("b", 130) == 144
    assert m.next_checkpoint_position("b", 148) is None  # past the last position it wants
    with pytest.raises((TypeError, ValueError)):
        m.next_checkpoint_position("b", -1)
