"""Host-side dispatch of the ops: where ids come from decides validation, one staging copy, devices agree,
run tables outlive buffers objects, grid axes are chunked.

A GPU-only path is exercised on the CPU with stand-ins: pools and buffers that report a CUDA device
(``pools.device == cuda:0``) while their memory stays on the CPU. Validation and device checks run before
anything would touch the device, so the rejections are real; where a test lets a call go through, the
one staging copy is replaced by a recording CPU copy.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import hybridkv.ops.states as states_mod
from hybridkv.ops import (
    _framework,
    _ids,
    allocate_pools,
    allocate_state_buffers,
    copy_blocks,
    gather_states,
    scatter_states,
)
from hybridkv.ops._framework import DeviceMismatchError, resolve_device, tile_words, word_and_align
from hybridkv.ops.addressing import RUN_DST_BASE
from hybridkv.ops.testing import fill_random_, interpreter_enabled, random_state_table, small_layout

needs_interpreter = pytest.mark.skipif(
    not interpreter_enabled(), reason="Triton kernels run on CPU only in Triton's interpreter: set TRITON_INTERPRET=1"
)
CUDA0 = torch.device("cuda", 0)


def as_if_on(obj, device: torch.device):
    """The same pools/buffers (same CPU memory) reporting ``device``: what the dispatcher branches on."""
    fake = type(f"{type(obj).__name__}On{device.type}", (type(obj),), {"device": property(lambda self: device)})
    return fake(**{f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})


class Copies:  # the shape of blockmgr's BlockCopies
    def __init__(self, src, dst):
        self.src, self.dst = src, dst


@pytest.fixture
def cuda_pools():
    pools = fill_random_(allocate_pools(small_layout(), "cpu", fill="nan"), seed=0)
    fake = as_if_on(pools, CUDA0)
    assert fake.device.type == "cuda" and fake.torch_data.device.type == "cpu"
    return fake


@pytest.fixture
def staged(monkeypatch):
    """Record each staging copy (arrays, target device) and do it on the CPU instead."""
    calls = []
    real = _ids.to_device

    def record(arrays, device, dtype):
        calls.append(([a.copy() for a in arrays], device))
        return real(arrays, torch.device("cpu"), dtype)

    monkeypatch.setattr(_ids, "to_device", record)
    return calls


HOST_FORMS = {
    "list": lambda ids: list(ids),
    "numpy": lambda ids: np.array(ids, dtype=np.int32),
    "cpu tensor": lambda ids: torch.tensor(ids),
}
BAD_COPIES = [
    ([1, 2], [2, 3], "both a source and a destination"),  # a chain: the copies would race
    ([1, 2], [5, 5], "appears twice"),
    ([4], [0], "null block"),
    ([1], [24], "outside the pool"),
    ([-1], [3], "outside the pool"),
]


@pytest.mark.parametrize("form", HOST_FORMS)
@pytest.mark.parametrize(("src", "dst", "message"), BAD_COPIES)
def test_copy_blocks_on_cuda_rejects_bad_host_ids_before_moving_them(cuda_pools, staged, form, src, dst, message):
    to = HOST_FORMS[form]
    before = cuda_pools.torch_data.clone()
    with pytest.raises(ValueError, match=message):
        copy_blocks(cuda_pools, to(src), to(dst), backend="naive")
    with pytest.raises(ValueError, match=message):
        copy_blocks(cuda_pools, Copies(to(src), to(dst)), backend="naive")
    assert staged == [] and torch.equal(cuda_pools.torch_data, before)


def test_copy_blocks_on_cuda_stages_valid_host_ids_once(cuda_pools, staged):
    before = cuda_pools.torch_data.clone()
    copy_blocks(cuda_pools, Copies(np.array([3, 7, 3]), [10, 2, 11]), backend="naive")
    assert len(staged) == 1, "src and dst travel in one staging copy"
    arrays, device = staged[0]
    assert device == CUDA0 and [a.tolist() for a in arrays] == [[3, 7, 3], [10, 2, 11]]
    for s, d in [(3, 10), (7, 2), (3, 11)]:
        assert torch.equal(cuda_pools.torch_data[:, :, d], before[:, :, s])


def test_device_ids_are_trusted_and_not_staged(monkeypatch, staged):
    """Ids that are already a tensor on the pools' device (here a stand-in device) skip validation."""
    meta = torch.device("meta")
    pools = as_if_on(allocate_pools(small_layout(), "cpu"), meta)
    seen = []
    monkeypatch.setattr("hybridkv.ops.blocks.copy_blocks_naive", lambda p, s, d: seen.append((s, d)))
    chain = torch.tensor([1, 2], device=meta), torch.tensor([2, 3], device=meta)
    copy_blocks(pools, *chain, backend="naive")  # the caller vouches: no check, no synchronisation
    assert staged == [] and len(seen) == 1 and seen[0][0].device == meta


def test_ids_on_another_device_raise_a_device_mismatch(cuda_pools, staged):
    meta_ids = torch.tensor([1, 2], device="meta")
    with pytest.raises(DeviceMismatchError, match=r"copy_blocks src_blocks: on meta, but the pools are on cuda:0"):
        copy_blocks(cuda_pools, meta_ids, [5, 6], backend="naive")
    cpu_pools = allocate_pools(small_layout(), "cpu")
    with pytest.raises(DeviceMismatchError, match="dst_blocks"):
        copy_blocks(cpu_pools, [1, 2], meta_ids, backend="naive")
    assert staged == []


def _states_setup(batch_size=3):
    layout = small_layout()
    pools = fill_random_(allocate_pools(layout, "cpu", fill="nan"), seed=1)
    table = random_state_table(layout, batch_size, seed=2, null_rows=(1,))
    return layout, pools, table


def test_states_on_cuda_reject_bad_host_tables_before_moving_them(staged):
    layout, pools, table = _states_setup()
    cuda_pools = as_if_on(pools, CUDA0)
    bufs = as_if_on(allocate_state_buffers(layout, 3, device="cpu"), CUDA0)
    for form in (lambda t: t, torch.from_numpy):
        out_of_range = table.copy()
        out_of_range[0, 2, 1] = layout.num_blocks
        with pytest.raises(ValueError, match="outside the pool"):
            gather_states(cuda_pools, form(out_of_range), None, bufs, backend="naive")
        written_twice = table.copy()
        written_twice[1, 0, 0] = written_twice[0, 2, 0]
        with pytest.raises(ValueError, match="twice"):
            scatter_states(cuda_pools, form(written_twice), None, bufs, backend="naive")
    assert staged == []
    gather_states(cuda_pools, table, None, bufs, backend="naive")
    assert len(staged) == 1 and staged[0][1] == CUDA0 and np.array_equal(staged[0][0][0], table)


def test_states_device_mismatch(staged):
    layout, pools, table = _states_setup()
    with pytest.raises(DeviceMismatchError, match="state buffers: on cpu, but the pools are on cuda:0"):
        gather_states(as_if_on(pools, CUDA0), table, None, allocate_state_buffers(layout, 3, device="cpu"))
    meta_bufs = allocate_state_buffers(layout, 3, device="meta")
    with pytest.raises(DeviceMismatchError, match="state buffers: on meta"):
        scatter_states(pools, table, None, meta_bufs)
    bufs = allocate_state_buffers(layout, 3, device="cpu")
    with pytest.raises(DeviceMismatchError, match="state table: on meta"):
        gather_states(pools, torch.from_numpy(table).to("meta"), None, bufs)
    assert staged == []


def test_run_table_is_shared_by_new_buffers_of_the_same_shape(monkeypatch):
    layout, pools, _ = _states_setup()
    builds = []
    real = states_mod.state_runs
    monkeypatch.setattr(states_mod, "state_runs", lambda *a, **k: builds.append(a) or real(*a, **k))
    monkeypatch.setattr(states_mod, "_RUN_TABLES", type(states_mod._RUN_TABLES)())

    def runs_for(bufs):
        sel = states_mod._select(pools, bufs, None, 3)
        word, align = word_and_align(pools.torch_data.data_ptr(), bufs.torch_data.data_ptr(), *sel.offsets)
        return states_mod.run_table(pools, sel.regions, sel.table_group, word, align, tile_words(word, align))

    first = runs_for(allocate_state_buffers(layout, 3, device="cpu"))
    second = runs_for(allocate_state_buffers(layout, 3, device="cpu"))  # a new buffers object, same shape
    assert second is first and len(builds) == 1
    other = runs_for(allocate_state_buffers(layout, 5, device="cpu"))  # another batch: other buffer offsets
    assert other is not first and len(builds) == 2
    assert not torch.equal(other[:, RUN_DST_BASE], first[:, RUN_DST_BASE])


@needs_interpreter
def test_gathers_into_fresh_buffers_build_the_run_table_once(monkeypatch):
    layout, pools, table = _states_setup()
    builds = []
    real = states_mod.state_runs
    monkeypatch.setattr(states_mod, "state_runs", lambda *a, **k: builds.append(a) or real(*a, **k))
    monkeypatch.setattr(states_mod, "_RUN_TABLES", type(states_mod._RUN_TABLES)())
    outs = [allocate_state_buffers(layout, 3, device="cpu", fill="nan") for _ in range(3)]
    for out in outs:  # an engine step allocating new buffers each time
        gather_states(pools, table, None, out, backend="triton")
    assert len(builds) == 1
    assert torch.equal(outs[0].torch_data, outs[2].torch_data)


@needs_interpreter
def test_batches_beyond_the_grid_limit_are_chunked(monkeypatch):
    monkeypatch.setattr(_framework, "MAX_GRID_YZ", 2)  # CUDA's 65,535 rows, scaled down
    layout = small_layout(num_blocks=40)
    pools = fill_random_(allocate_pools(layout, "cpu", fill="nan"), seed=4)
    table = random_state_table(layout, 5, seed=5, null_rows=(3,))
    want = allocate_state_buffers(layout, 5, device="cpu", fill="nan")
    got = allocate_state_buffers(layout, 5, device="cpu", fill="nan")
    gather_states(pools, table, None, want, backend="naive")
    gather_states(pools, table, None, got, backend="triton")
    assert torch.equal(got.torch_data, want.torch_data)
    ref = allocate_pools(layout, "cpu")
    ref.torch_data.copy_(pools.torch_data)
    got.torch_data.random_(0, 255)
    scatter_states(ref, table, None, got, backend="naive")
    scatter_states(pools, table, None, got, backend="triton")
    assert torch.equal(pools.torch_data, ref.torch_data)
    monkeypatch.setattr(_framework, "MAX_GRID_YZ", 1)  # every slot-segment and tile its own launch
    big = small_layout(pattern="RRR", state_block_bytes=20_000, num_blocks=12)
    a = fill_random_(allocate_pools(big, "cpu"), seed=6)
    b = fill_random_(allocate_pools(big, "cpu"), seed=6)
    copy_blocks(a, [1, 5, 5], [7, 8, 9], backend="naive")
    copy_blocks(b, [1, 5, 5], [7, 8, 9], backend="triton")
    assert torch.equal(a.torch_data, b.torch_data)


def test_cuda_without_an_index_means_the_current_device_of_the_allocating_framework(monkeypatch):
    """torch allocations: torch's current device; Paddle allocations: Paddle's (a FastDeploy worker
    sets Paddle's device and may have no torch at all)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device("cpu") == torch.device("cpu")
    paddle = pytest.importorskip("paddle")
    places = []
    monkeypatch.setattr(paddle, "CUDAPlace", lambda index: places.append(index) or index)
    monkeypatch.setattr(paddle.device, "get_device", lambda: "gpu:3")
    _framework.paddle_place_for("cuda")
    _framework.paddle_place_for(torch.device("cuda", 2))
    _framework.paddle_place_for("gpu:1")
    assert places == [3, 2, 1]
    assert _framework.resolve_paddle_device("cuda") == torch.device("cuda", 3)
    assert _framework.resolve_paddle_device(torch.device("cpu")) == torch.device("cpu")


def test_word_alignment_and_tiles():
    assert word_and_align(256, 48, 144) == (8, 2)
    assert word_and_align(256, 48, 24) == (8, 1)
    assert word_and_align(256, 420, 36) == (4, 1)
    assert word_and_align(256, 10, 6) == (2, 1)
    assert word_and_align(256, 9) == (1, 1)
    assert [tile_words(*word_and_align(a)) * word_and_align(a)[0] for a in (1, 2, 4, 8, 16)] == [
        1024,
        2048,
        4096,
        8192,
        8192,
    ]
