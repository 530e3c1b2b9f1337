"""The facade's own surface: the engine contract (bind_engine, tickets), exact counts and the metrics
an operator reads, v1's ``[]``, the calls 7808a119 added, pending prefix matches, and the two
``allocate_gpu_blocks`` forms, and the host tier: FastDeploy's CPU-cache config, host hits admitted
at their match and reported in ``hit_info`` / ``match_result`` as FastDeploy reports them. The call
order of FastDeploy's scheduler is in ``tests/test_fastdeploy_conformance.py``."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.prefix import PrefixCacheConfig
from hybridkv.errors import NoFreeBlocksError, RequestStateError
from hybridkv.integrations.fastdeploy.facade import PATCH_SERIES, EnginePatchError, FastDeployBlockManager
from tests.test_fastdeploy_world import BLOCK_SIZE, STATE_BLOCKS, Request, tiny_layout


def bound(num_blocks: int = 17, v1: bool = False, prefix: PrefixCacheConfig | None = None, role: str = "mixed"):
    fd = FastDeployBlockManager(HybridBlockManager(tiny_layout(num_blocks), prefix_cache=prefix))
    fd.bind_engine(PATCH_SERIES, cache_manager_v1=v1, splitwise_role=role)
    fd.begin_step()  # E4: the patched engine's first schedule() starts with it
    return fd


def admit(fd: FastDeployBlockManager, rid: str, n: int, v1: bool = False) -> list[int]:
    """What the patched WAITING branch does: take the ticket, then allocate n (state sets included)."""
    req = SimpleNamespace(request_id=rid)
    assert fd.state_blocks_for(req) == STATE_BLOCKS
    return fd.allocate_gpu_blocks(req, n) if v1 else fd.allocate_gpu_blocks(n, rid)


# ---- the contract -----------------------------------------------------------------------------------
GUARDED = [
    ("can_allocate_gpu_blocks", (1,)),
    ("allocate_gpu_blocks", (5, "a")),
    ("recycle_gpu_blocks", ([1], "a")),
    ("release_block_ids", (Request("a", [1, 2], 1),)),
    ("request_finish", (Request("a", [1, 2], 1),)),
    ("request_match_blocks", (Request("a", [1, 2], 1), BLOCK_SIZE)),
    ("match_prefix", (Request("a", [1, 2], 1),)),
    ("update_cache_blocks", (Request("a", [1, 2], 1), BLOCK_SIZE, 0)),
    ("write_cache_to_storage", (Request("a", [1, 2], 1),)),
    ("write_cache_to_storage_decode", (Request("a", [1, 2], 1),)),
    ("issue_pending_backup_to_batch_request", ()),
    ("check_and_add_pending_backup", ()),
    ("begin_step", ()),
    ("next_checkpoint_position", (Request("a", [1, 2], 1),)),
    ("task_fields", ("a",)),
    ("state_blocks_for", (Request("a", [1, 2], 1),)),
    ("update_cache_config", (SimpleNamespace(total_block_num=30),)),
    ("take_tier_copies", ()),
]


@pytest.mark.parametrize(("name", "args"), GUARDED, ids=[g[0] for g in GUARDED])
def test_an_engine_that_did_not_bind_gets_a_typed_error_naming_the_patch_and_nothing_changes(name, args):
    fd = FastDeployBlockManager(HybridBlockManager(tiny_layout(17)))
    assert fd.num_gpu_blocks == 17 and len(fd.gpu_free_block_list) == 16  # ResourceManager.info() reads
    with pytest.raises(EnginePatchError, match=rf"{name}: no engine bound.*{PATCH_SERIES}.*bind_engine"):
        getattr(fd, name)(*args)
    assert not fd.manager.requests and fd.manager.pool.num_free == 16


def test_bind_engine_checks_the_series_the_mode_and_the_role_and_binds_once():
    fd = FastDeployBlockManager(HybridBlockManager(tiny_layout(17)))
    with pytest.raises(EnginePatchError, match="patch series 'hybridkv-fastdeploy-0fe1d25/1'"):
        fd.bind_engine("hybridkv-fastdeploy-0fe1d25/1", cache_manager_v1=False)
    for bad in (2, -1, "1", 1.0, None):  # develop c1b7c083 passes its env int 0 / 1; nothing else is a mode
        with pytest.raises(TypeError, match="cache_manager_v1 must be a bool or 0 / 1"):
            fd.bind_engine(PATCH_SERIES, cache_manager_v1=bad)
    with pytest.raises(ValueError, match="splitwise_role"):
        fd.bind_engine(PATCH_SERIES, cache_manager_v1=False, splitwise_role="both")
    fd.bind_engine(PATCH_SERIES, cache_manager_v1=1)  # develop's int: v1 mode
    with pytest.raises(RequestStateError, match="bound to this facade already"):
        fd.bind_engine(PATCH_SERIES, cache_manager_v1=False)
    with pytest.raises(TypeError, match="v1 mode calls allocate_gpu_blocks\\(request, n\\)"):
        fd.allocate_gpu_blocks(5, "a")  # the legacy form from an engine bound in v1 mode


@pytest.mark.parametrize("n", [3, 4, 5, 16])
def test_a_first_allocation_without_its_ticket_raises_whatever_it_asks(n):
    """Patch E2 missing: the facade never reads a count as 'includes the state sets'. A prompt longer
    than the state (n >= S) used to return n - S KV ids, so FastDeploy scheduled tokens past them."""
    fd = bound()
    with pytest.raises(EnginePatchError, match="state_blocks_for"):
        fd.allocate_gpu_blocks(n, "a")
    v1 = bound(v1=True)
    with pytest.raises(EnginePatchError, match="state_blocks_for"):
        v1.allocate_gpu_blocks(SimpleNamespace(request_id="a"), n)
    assert not fd.manager.requests and not v1.manager.requests and fd.manager.pool.num_free == 16


def test_tickets_lapse_at_begin_step_and_on_release():
    fd = bound()
    req = SimpleNamespace(request_id="a")
    assert fd.state_blocks_for(req) == STATE_BLOCKS
    fd.begin_step()
    with pytest.raises(EnginePatchError):
        fd.allocate_gpu_blocks(6, "a")
    assert fd.state_blocks_for(req) == STATE_BLOCKS and len(fd.allocate_gpu_blocks(6, "a")) == 2
    assert fd.state_blocks_for(req) == 0  # admitted: nothing more to charge
    fd.release_block_ids(req)
    with pytest.raises(EnginePatchError):
        fd.allocate_gpu_blocks(6, "a")


# ---- counts and metrics -----------------------------------------------------------------------------
def test_counting_is_exact_and_metrics_count_state_and_cached_blocks_as_used():
    fd = bound(17)  # 16 usable: block 0 is hybridkv's null block
    assert fd.num_gpu_blocks == 17 and fd.num_state_blocks_per_request == STATE_BLOCKS  # total_block_number()
    assert fd.can_allocate_gpu_blocks(16) and not fd.can_allocate_gpu_blocks(17)
    ids = admit(fd, "a", 6)  # 4 state blocks + 2 KV blocks
    assert len(ids) == 2 and fd.num_free_device_blocks == 10 and len(fd.gpu_free_block_list) == 10
    assert fd.available_gpu_resource == 10 / 17  # get_gpu_cache_usage_perc: the state blocks count as used
    assert len(fd.allocate_gpu_blocks(10, "a")) == 10 and fd.can_allocate_gpu_blocks(0)
    fd.recycle_gpu_blocks(ids, "a")  # part of its blocks: nothing is freed yet
    assert "a" in fd.manager.requests
    fd.recycle_gpu_blocks(fd.manager.requests["a"].kv_blocks.tolist()[2:], "a")
    assert not fd.manager.requests and len(fd.gpu_free_block_list) == 16
    fd.update_cache_config(SimpleNamespace(total_block_num=99))  # the profiled size, while idle
    assert fd.num_gpu_blocks == 99 and fd.manager.pool.num_usable == 98
    admit(fd, "d", 5)
    with pytest.raises(RequestStateError, match="while requests hold blocks"):
        fd.update_cache_config(SimpleNamespace(total_block_num=50))


def test_cached_blocks_are_used_until_evicted_as_fastdeploys_cache_managers_count_them():
    cfg = PrefixCacheConfig(checkpoint="every_n_blocks", every_n=1)
    fd = bound(33, prefix=cfg)
    seed = Request("s", list(range(16)), max_tokens=1)
    fd.request_match_blocks(seed, BLOCK_SIZE)
    admit(fd, "s", 4 + STATE_BLOCKS)
    seed.num_computed_tokens = 16
    fd.update_cache_blocks(seed, BLOCK_SIZE, 16)  # a checkpoint at 16 (4 more blocks)
    fd.begin_step()
    fd.release_block_ids(seed)
    fd.begin_step()
    cached = fd.num_evictable_blocks
    assert cached == 4 + STATE_BLOCKS  # the KV chain and its checkpoint, no request holds them
    assert len(fd.gpu_free_block_list) == 32 - cached  # not free: FastDeploy shows them used
    assert fd.num_free_device_blocks == 32 and fd.can_allocate_gpu_blocks(32)  # yet an allocation may take them


# ---- v1 CacheManager and the calls 7808a119 makes ---------------------------------------------------------
def test_v1_allocate_returns_empty_only_when_the_blocks_are_not_there_and_changes_nothing():
    fd = bound(17, v1=True)
    req = SimpleNamespace(request_id="c")
    fd.state_blocks_for(req)
    assert fd.allocate_gpu_blocks(req, 17) == [] and not fd.manager.requests  # 16 usable: what CacheManager does
    assert fd.num_free_device_blocks == 16
    with pytest.raises(EnginePatchError):  # no ticket: an error in the v1 form too, never []
        fd.allocate_gpu_blocks(SimpleNamespace(request_id="d"), 5)
    assert fd.state_blocks_for(req) == STATE_BLOCKS and len(fd.allocate_gpu_blocks(req, 5)) == 1
    legacy = bound(17)
    legacy.state_blocks_for(req)
    with pytest.raises(NoFreeBlocksError):
        legacy.allocate_gpu_blocks(17, "c")


def test_the_storage_and_backup_calls_of_7808a119_answer_as_cachemanager_does_without_a_host_tier():
    fd = bound(17, v1=True)
    ids = admit(fd, "a", 6, v1=True)
    req = Request("a", [1] * 8, 1)
    req.block_tables = ids
    assert fd.issue_pending_backup_to_batch_request() is None and fd.get_pending_backup_count() == 0
    assert fd.check_and_add_pending_backup() is None and fd.num_cpu_blocks == 0
    assert fd.write_cache_to_storage_decode(req) is None and fd.write_cache_to_storage(req) is None
    assert "a" in fd.manager.requests  # writing to storage frees nothing; _free_blocks does
    fd.request_finish(req)
    assert not fd.manager.requests


# ---- pending matches: each pinned block counted once, a defined lifetime ------------------------------
PREFIX = list(range(40))  # 10 blocks; its checkpoint at 40 holds 4 state blocks: a hit pins 14 blocks


def _facade_with_cached_prefix(num_blocks: int = 64, v1: bool = False) -> FastDeployBlockManager:
    fd = bound(num_blocks, v1=v1, prefix=PrefixCacheConfig(checkpoint="every_n_blocks", every_n=1))
    seed = Request("seed", list(PREFIX), max_tokens=1)
    fd.request_match_blocks(seed, BLOCK_SIZE)
    fd.state_blocks_for(seed)
    fd.allocate_gpu_blocks(seed, 10 + STATE_BLOCKS) if v1 else fd.allocate_gpu_blocks(10 + STATE_BLOCKS, "seed")
    seed.num_computed_tokens = len(PREFIX)
    fd.update_cache_blocks(seed, BLOCK_SIZE, len(PREFIX))  # the checkpoint at 40
    fd.begin_step()
    fd.release_block_ids(seed)
    fd.begin_step()
    assert fd.num_free_device_blocks == fd.manager.pool.num_usable  # everything cached is evictable
    return fd


def _follower(i: int) -> Request:
    return Request(f"b{i}", [*PREFIX, 900 + i], max_tokens=1)


def test_matches_of_one_cached_prefix_count_their_pinned_blocks_once():
    fd = _facade_with_cached_prefix()
    free = fd.num_free_device_blocks
    ids, hit, _ = fd.request_match_blocks(_follower(0), BLOCK_SIZE)
    assert hit == 40 and len(ids) == 10
    assert fd.num_free_device_blocks == free - 14  # the 10 KV blocks and the checkpoint's 4
    followers = [_follower(i) for i in range(5)]
    for r in followers:
        assert fd.request_match_blocks(r, BLOCK_SIZE)[1] == 40
    assert fd.num_free_device_blocks == free - 14  # 5 matches of one hit pin the same 14 blocks
    assert fd.can_allocate_gpu_blocks(free - 14) and not fd.can_allocate_gpu_blocks(free - 13)
    for r in followers:  # each admission takes exactly what it asks (1 KV block + the state sets)
        before = fd.num_free_device_blocks
        fd.state_blocks_for(r)
        assert fd.allocate_gpu_blocks(1 + STATE_BLOCKS, r.request_id)
        assert before - fd.num_free_device_blocks == 1 + STATE_BLOCKS, r.request_id
        assert fd.manager.requests[r.request_id].kv_blocks[:10].tolist() == ids
    fd.manager.check_integrity()


def test_an_abandoned_match_lapses_at_the_next_step_and_a_new_match_replaces_the_old():
    fd = _facade_with_cached_prefix(v1=True)
    free = fd.num_free_device_blocks
    r = _follower(0)
    for _ in range(3):
        fd.match_prefix(r)
    assert fd.num_free_device_blocks == free - 14
    fd.match_prefix(Request("b0", [7] * 41, max_tokens=1))  # the same request, a miss now: it pins nothing
    assert fd.num_free_device_blocks == free
    fd.match_prefix(r)  # the hit again, never allocated nor released
    fd.begin_step()  # the next schedule(): the abandoned match lapses
    assert fd.num_free_device_blocks == free == fd.manager.pool.num_usable
    fd.state_blocks_for(r)
    with pytest.raises(RequestStateError, match="lapsed at begin_step"):  # its block_tables name the hit
        fd.allocate_gpu_blocks(r, 1 + STATE_BLOCKS)  # an error in the v1 form too: CacheManager never sees this
    assert not fd.manager.requests and fd.num_free_device_blocks == free
    fd.match_prefix(r)  # matched again and allocated in the same step: exactly what it asks
    before = fd.num_free_device_blocks
    fd.state_blocks_for(r)
    assert before == free - 14 and fd.allocate_gpu_blocks(r, 1 + STATE_BLOCKS)
    assert before - fd.num_free_device_blocks == 1 + STATE_BLOCKS
    fd.request_finish(r)
    fd.begin_step()
    assert fd.num_free_device_blocks == free
    fd.manager.check_integrity()


def test_update_cache_blocks_checkpoints_only_where_a_chunk_of_this_step_ends():
    """``preallocate_resource_in_p`` calls update_cache_blocks(request, bs, need_prefill_tokens) before
    any chunk ran: no checkpoint copy may be queued then (it would run after the wrong forward)."""
    fd = bound(64, prefix=PrefixCacheConfig(checkpoint="every_n_blocks", every_n=1), role="prefill")
    req = Request("p", list(range(16)), max_tokens=1)
    fd.request_match_blocks(req, BLOCK_SIZE)
    fd.state_blocks_for(req)
    req.block_tables = fd.allocate_gpu_blocks(4 + STATE_BLOCKS, "p")
    fd.update_cache_blocks(req, BLOCK_SIZE, 16)  # num_computed_tokens is 0: nothing ran yet
    assert not getattr(req, "checkpoint_copies", None)
    req.num_computed_tokens = 16  # the chunk [0, 16) was scheduled this step
    fd.update_cache_blocks(req, BLOCK_SIZE, 16)
    assert req.checkpoint_copies[0]


def test_a_checkpoint_reserved_by_an_engine_that_never_ran_begin_step_raises_naming_e4():
    """Found by running FastDeploy 7808a119's own ResourceManagerV1 over the facade with the series but
    without E4: checkpoint pins are released only at begin_step, so each reserved checkpoint stayed
    pinned (56 blocks per checkpoint for MiniMax-M1), never came back and never served a hit, silently.
    The facade refuses the first reservation instead, before it changes anything."""
    fd = FastDeployBlockManager(
        HybridBlockManager(tiny_layout(64), prefix_cache=PrefixCacheConfig(checkpoint="every_n_blocks", every_n=1))
    )
    fd.bind_engine(PATCH_SERIES, cache_manager_v1=False, splitwise_role="mixed")  # E0, but no begin_step (E4)
    req = Request("p", list(range(16)), max_tokens=1)
    fd.request_match_blocks(req, BLOCK_SIZE)
    fd.state_blocks_for(req)
    req.block_tables = fd.allocate_gpu_blocks(4 + STATE_BLOCKS, "p")
    req.num_computed_tokens = 16  # the chunk [0, 16) was scheduled this step: a checkpoint position
    free, held = fd.num_free_device_blocks, fd.manager.pool.num_free
    with pytest.raises(EnginePatchError, match=r"update_cache_blocks: .*begin_step.* patch E4"):
        fd.update_cache_blocks(req, BLOCK_SIZE, 16)
    assert not getattr(req, "checkpoint_copies", None)  # nothing reserved, nothing pinned
    assert (fd.num_free_device_blocks, fd.manager.pool.num_free) == (free, held)
    fd.manager.check_integrity()
    fd.begin_step()  # the patched schedule()'s first line: the same call reserves the checkpoint
    fd.update_cache_blocks(req, BLOCK_SIZE, 16)
    assert req.checkpoint_copies[0]
    fd.begin_step()
    fd.release_block_ids(req)
    fd.begin_step()
    assert fd.num_free_device_blocks == fd.manager.pool.num_usable  # the checkpoint is evictable: it came back


# ---- allocate_gpu_blocks: the form is chosen on exact types -----------------------------------------
@pytest.mark.parametrize("first", [2.5, 2.0, True, "3", None, [3], b"3"])
def test_allocate_gpu_blocks_refuses_a_first_argument_of_neither_form(first):
    fd = bound()
    both_forms = r"allocate_gpu_blocks\(num_blocks: int, req_id\).*allocate_gpu_blocks\(request, num_blocks: int\)"
    with pytest.raises(TypeError, match=both_forms):
        fd.allocate_gpu_blocks(first, "B")
    assert not fd.manager.requests and fd.num_free_device_blocks == 16


@pytest.mark.parametrize("count", [2.5, 6.0, True, "6", None])
def test_allocate_gpu_blocks_refuses_a_count_that_is_not_an_integer(count):
    fd = bound(v1=True)
    with pytest.raises(TypeError, match="num_blocks must be an integer"):
        fd.allocate_gpu_blocks(SimpleNamespace(request_id="c"), count)  # v1: a TypeError, not []
    with pytest.raises(TypeError):
        fd.can_allocate_gpu_blocks(count)
    assert not fd.manager.requests and fd.num_free_device_blocks == 16


def test_allocate_gpu_blocks_takes_both_forms_positionally_and_by_keyword():
    fd = bound()
    for rid in "ab":
        fd.state_blocks_for(SimpleNamespace(request_id=rid))
    assert len(fd.allocate_gpu_blocks(np.int64(5), "a")) == 1
    assert len(fd.allocate_gpu_blocks(num_blocks=5, req_id="b")) == 1
    v1 = bound(v1=True)
    for rid in "cd":
        v1.state_blocks_for(SimpleNamespace(request_id=rid))
    assert len(v1.allocate_gpu_blocks(SimpleNamespace(request_id="c"), num_blocks=5)) == 1
    assert len(v1.allocate_gpu_blocks(request=SimpleNamespace(request_id="d"), num_blocks=5)) == 1
    for args, kwargs in (
        ((5, "d"), {"request": SimpleNamespace(request_id="d")}),
        ((SimpleNamespace(request_id="d"), 1), {"req_id": "d"}),
        ((1, "d", 3), {}),
        ((1,), {"req_id": "d", "blocks": 1}),
        ((SimpleNamespace(request_id="d"), 1), {"num_blocks": 1}),
        ((SimpleNamespace(request_id="d"),), {}),
    ):
        with pytest.raises(TypeError, match="allocate_gpu_blocks"):
            fd.allocate_gpu_blocks(*args, **kwargs)
    # a negative count (develop c1b7c083's get_new_block_nums has no max(block_num, 0)) is answered as
    # FastDeploy's managers answer it: can_allocate True, allocate nothing
    free = v1.manager.pool.num_free
    assert v1.can_allocate_gpu_blocks(-2) and fd.can_allocate_gpu_blocks(-1)
    assert v1.allocate_gpu_blocks(SimpleNamespace(request_id="c"), -1) == []
    assert fd.allocate_gpu_blocks(-2, "a") == [] and v1.manager.pool.num_free == free
    with pytest.raises(TypeError, match="integer"):
        fd.can_allocate_gpu_blocks(1.5)
    assert sorted(fd.manager.requests) == ["a", "b"] and sorted(v1.manager.requests) == ["c", "d"]
    fd.manager.check_integrity()


# ---- the host tier: FastDeploy's CPU-cache config, host hits reported as FastDeploy reports them --------------
def _cache_config(**kw) -> SimpleNamespace:
    base = {"block_size": BLOCK_SIZE, "enable_prefix_caching": True, "swap_space": None, "num_cpu_blocks": None}
    return SimpleNamespace(**(base | kw))


TIER_PREFIX = PrefixCacheConfig(checkpoint="every_n_blocks", every_n=2)


def test_from_cache_config_maps_swap_space_and_num_cpu_blocks_to_the_host_tier():
    layout = tiny_layout(40)
    fd = FastDeployBlockManager.from_cache_config(layout, _cache_config(swap_space=1e-4), prefix=TIER_PREFIX)
    host = int(1e-4 * 2**30 // layout.bytes_per_block)
    assert fd.manager.host_pool.num_usable == host == fd.num_cpu_blocks > 0  # swap_space wins over num_cpu_blocks
    assert fd.manager.prefix_cache.tier is not None and fd.manager.prefix_cache.config.every_n == 2
    fd = FastDeployBlockManager.from_cache_config(layout, _cache_config(num_cpu_blocks=30))
    assert fd.num_cpu_blocks == 30 and fd.manager.prefix_cache.config.host_tier
    no_tier = FastDeployBlockManager.from_cache_config(layout, _cache_config(enable_prefix_caching=False, swap_space=1))
    assert no_tier.manager.prefix_cache is None and no_tier.manager.host_pool is not None
    assert no_tier.num_cpu_blocks == 0  # a swap-only host pool is not FastDeploy's CPU cache
    plain = FastDeployBlockManager.from_cache_config(layout, _cache_config())
    assert plain.manager.host_pool is None and plain.manager.prefix_cache.tier is None and plain.num_cpu_blocks == 0


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"swap_space": -1}, ValueError, "swap_space"),
        ({"swap_space": float("nan")}, ValueError, "swap_space"),
        ({"swap_space": "4"}, TypeError, "swap_space"),
        ({"swap_space": True}, TypeError, "swap_space"),
        ({"swap_space": 1e-9}, ValueError, "holds no block"),
        ({"num_cpu_blocks": -3}, ValueError, "num_cpu_blocks"),
        ({"num_cpu_blocks": 2.5}, TypeError, "num_cpu_blocks"),
        ({"block_size": 8}, ValueError, "block_size"),
        ({"enable_prefix_caching": 1}, TypeError, "enable_prefix_caching"),
    ],
)
def test_from_cache_config_refuses_a_bad_cpu_cache_config_before_building_anything(kw, error, match):
    with pytest.raises(error, match=match):
        FastDeployBlockManager.from_cache_config(tiny_layout(40), _cache_config(**kw))
    with pytest.raises(ValueError, match="enable_prefix_caching is False"):
        FastDeployBlockManager.from_cache_config(tiny_layout(40), _cache_config(enable_prefix_caching=False),
                                                 prefix=TIER_PREFIX)  # fmt: skip


PREFIX_A = list(range(100, 124))  # 6 blocks; checkpoints at 8, 16, 24 (every 2 blocks)


def _offloaded(v1: bool = False, gpu=None, num_blocks: int = 40) -> FastDeployBlockManager:
    """A bound facade whose request "a" ran PREFIX_A, finished, and had its cached blocks pushed to
    the host tier by a request with tokens of its own that took the whole device."""
    fd = FastDeployBlockManager.from_cache_config(tiny_layout(num_blocks), _cache_config(num_cpu_blocks=120),
                                                  prefix=TIER_PREFIX, gpu=gpu)  # fmt: skip
    fd.bind_engine(PATCH_SERIES, cache_manager_v1=v1, splitwise_role="mixed")
    fd.begin_step()
    a = Request("a", list(PREFIX_A), max_tokens=1)
    fd.request_match_blocks(a, BLOCK_SIZE)
    admit(fd, "a", 2 + STATE_BLOCKS, v1=v1)
    for end in (8, 16, 24):  # three chunks of 2 blocks, a checkpoint after each
        a.num_computed_tokens = end
        fd.update_cache_blocks(a, BLOCK_SIZE, end)
        fd.begin_step()
        if end < 24:
            fd.allocate_gpu_blocks(a, 2) if v1 else fd.allocate_gpu_blocks(2, "a")
    fd.release_block_ids(a)
    fd.begin_step()
    big = fd.num_free_device_blocks - STATE_BLOCKS
    admit(fd, "big", big + STATE_BLOCKS, v1=v1)  # evicts (offloads) everything cached
    fd.take_tier_copies()
    fd.release_block_ids(SimpleNamespace(request_id="big"))
    fd.begin_step()
    assert fd.manager.prefix_cache.num_cached_kv == 0 and fd.manager.prefix_cache.tier.num_units
    return fd


def test_a_host_hit_is_admitted_at_its_match_and_hit_info_splits_it_as_fastdeploy_does():
    from hybridkv.scheduler_adapter.cost import GpuSpec

    gpu = GpuSpec("test", flops_per_s=1e15, host_link_bytes_per_s=5.53e10, hbm_bytes_per_s=4.8e12)
    fd = _offloaded(gpu=gpu)
    m, stats = fd.manager, fd.manager.prefix_cache.stats
    host_before, free_before = stats.hit_tokens_host, fd.num_free_device_blocks
    b = Request("b", [*PREFIX_A, 7, 7, 7], max_tokens=1)
    common, hit, info = fd.request_match_blocks(b, BLOCK_SIZE)
    assert hit == 24 and b.num_cached_blocks == len(common) == 6
    assert info["cpu_match_token_num"] == stats.hit_tokens_host - host_before == 24  # all of it from the host
    assert info["gpu_match_token_num"] + info["cpu_match_token_num"] == hit
    assert info["cpu_cache_blocks"] == len(info["gpu_recv_block_ids"]) == 6 and info["gpu_cache_blocks"] == 0
    assert sorted(common) == sorted(info["match_gpu_block_ids"] + info["gpu_recv_block_ids"])
    assert m.requests["b"].kv_blocks.tolist() == common  # admitted: the table names the receiving blocks
    onload = 6 + STATE_BLOCKS  # its KV blocks, and the checkpoint at 24 straight into the live sets
    assert info["cpu_cache_prepare_bytes"] == onload * m.layout.bytes_per_block
    assert info["cpu_cache_prepare_time"] == pytest.approx(onload * m.layout.bytes_per_block / 5.53e10)
    # the match took the receiving blocks (as FastDeploy's does); the state sets wait for E2's allocation
    assert fd.num_free_device_blocks == free_before - 6
    assert fd.state_blocks_for(b) == STATE_BLOCKS
    before = fd.num_free_device_blocks
    assert len(fd.allocate_gpu_blocks(1 + STATE_BLOCKS, "b")) == 1  # the last token's block
    assert before - fd.num_free_device_blocks == 1 + STATE_BLOCKS and fd.state_blocks_for(b) == 0
    copies = fd.take_tier_copies()
    assert copies["onload"][0][:6] == info["gpu_recv_block_ids"] and len(copies["onload"][0]) == onload
    assert fd.metrics.req_count == 2 and fd.metrics.total_cpu_matched_token_num == 24  # a's miss, b's host hit
    assert fd.metrics.cpu_hit_token_ratio == fd.metrics.hit_token_ratio == 24 / (24 + 27)
    m.check_integrity()


def test_a_v1_host_hit_reports_its_host_nodes_and_the_whole_table():
    fd = _offloaded(v1=True)
    b = Request("b", [*PREFIX_A, 7, 7, 7], max_tokens=1)
    fd.match_prefix(b)
    r = b.match_result
    assert r.matched_host_nums * BLOCK_SIZE == 24 and r.total_matched_blocks == 6 and r.matched_device_nums == 0
    assert r.device_block_ids == fd.manager.requests["b"].kv_blocks.tolist()  # what the engine extends
    fd.state_blocks_for(b)
    before = fd.num_free_device_blocks
    assert len(fd.allocate_gpu_blocks(b, 1 + STATE_BLOCKS)) == 1 and before - fd.num_free_device_blocks == 5
    assert fd._prepare_time(10**6) == 0.0  # no GpuSpec: the facade does not time copies it does not run
    fd.request_finish(b)
    fd.begin_step()  # its host -> device copies were not handed out (no E9 yet): their blocks stay held
    assert fd.num_free_device_blocks == fd.manager.pool.num_usable - 6 - STATE_BLOCKS
    assert len(fd.take_tier_copies()["onload"][0]) == 6 + STATE_BLOCKS  # E9 of a later step
    fd.begin_step()
    assert fd.num_free_device_blocks == fd.manager.pool.num_usable
    fd.manager.check_integrity()


def test_a_host_hit_that_does_not_fit_changes_nothing_and_one_never_allocated_lapses():
    from tests.test_manager_atomic import snapshot

    fd = _offloaded()
    m = fd.manager
    admit(fd, "x", fd.num_free_device_blocks - 3)  # leaves 3 blocks: the hit needs 6 + 4
    fd.take_tier_copies()
    tier = m.prefix_cache.tier
    before = snapshot(m), dict(tier.kv), list(tier._lru), replace(fd.metrics), fd.num_free_device_blocks
    with pytest.raises(NoFreeBlocksError):
        fd.request_match_blocks(Request("b", [*PREFIX_A, 7], max_tokens=1), BLOCK_SIZE)
    after = snapshot(m), dict(tier.kv), list(tier._lru), fd.metrics, fd.num_free_device_blocks
    assert after == before and fd.take_tier_copies() is None
    fd.release_block_ids(SimpleNamespace(request_id="x"))
    fd.begin_step()
    free = fd.num_free_device_blocks
    b = Request("b", [*PREFIX_A, 7], max_tokens=1)
    assert fd.request_match_blocks(b, BLOCK_SIZE)[1] == 24 and "b" in m.requests
    fd.begin_step()  # never allocated: given back, and its allocation refuses until matched again
    assert "b" not in m.requests
    fd.state_blocks_for(b)
    with pytest.raises(RequestStateError, match="lapsed"):
        fd.allocate_gpu_blocks(1 + STATE_BLOCKS, "b")
    assert fd.take_tier_copies()["onload"][0]  # its onloads still run (the blocks they fill stay cached)
    fd.begin_step()
    assert fd.num_free_device_blocks == free == m.pool.num_usable
    assert m.prefix_cache.match([*PREFIX_A, 7], 25).num_tokens == 24  # on the device now
    m.check_integrity()


def test_a_hit_partly_on_the_device_lists_its_blocks_in_chain_order_and_says_which_came_from_the_host():
    fd = _offloaded()
    c = Request("c", [*PREFIX_A[:8], 9, 9, 9], max_tokens=1)  # its host hit brings blocks 0, 1 back
    assert fd.request_match_blocks(c, BLOCK_SIZE)[1] == 8
    fd.state_blocks_for(c)
    fd.allocate_gpu_blocks(1 + STATE_BLOCKS, "c")
    fd.take_tier_copies()
    fd.release_block_ids(c)
    fd.begin_step()
    b = Request("b", [*PREFIX_A, 7], max_tokens=1)
    common, hit, info = fd.request_match_blocks(b, BLOCK_SIZE)
    assert hit == 24 and (info["gpu_match_token_num"], info["cpu_match_token_num"]) == (8, 16)
    assert common[:2] == info["match_gpu_block_ids"] and common[2:] == info["gpu_recv_block_ids"]
    assert common == fd.manager.requests["b"].kv_blocks.tolist()
    fd.state_blocks_for(b)
    assert len(fd.allocate_gpu_blocks(1 + STATE_BLOCKS, "b")) == 1
    onload = fd.take_tier_copies()["onload"]
    assert onload[0][:4] == common[2:] and len(onload[0]) == 4 + STATE_BLOCKS  # and the checkpoint at 24
    fd.manager.check_integrity()


@pytest.mark.parametrize("v1", [False, True], ids=["legacy", "v1"])
def test_a_refused_first_allocation_of_a_host_hit_changes_nothing(v1):
    from tests.test_manager_atomic import snapshot

    fd = _offloaded(v1=v1)
    b = Request("b", [*PREFIX_A, 7], max_tokens=1)
    fd.match_prefix(b) if v1 else fd.request_match_blocks(b, BLOCK_SIZE)
    fd.state_blocks_for(b)
    too_many = fd.num_free_device_blocks + 1
    before = snapshot(fd.manager), fd.num_free_device_blocks
    if v1:
        assert fd.allocate_gpu_blocks(b, too_many) == []  # what CacheManager returns
    else:
        with pytest.raises(NoFreeBlocksError):
            fd.allocate_gpu_blocks(too_many, "b")
    assert (snapshot(fd.manager), fd.num_free_device_blocks) == before
    with pytest.raises(RequestStateError, match="fewer than the 4 state blocks"):
        fd.allocate_gpu_blocks(b, 3) if v1 else fd.allocate_gpu_blocks(3, "b")
    assert (snapshot(fd.manager), fd.num_free_device_blocks) == before
    ids = fd.allocate_gpu_blocks(b, too_many - 1) if v1 else fd.allocate_gpu_blocks(too_many - 1, "b")
    assert len(ids) == too_many - 1 - STATE_BLOCKS and fd.num_free_device_blocks == 0
    fd.manager.check_integrity()
