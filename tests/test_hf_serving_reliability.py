"""The transformers engine under what goes wrong: settings it cannot serve, parallel samples that do
not fit, bad requests, and exceptions inside a step.

Oracle: the same unmodified tiny model alone in transformers (one forward over the tokens so far per
generated token, sampled with :func:`~hybridkv.integrations.transformers.sampling.sample`, the
engine's pure function of logits, seed and position), and ``manager.check_integrity()``.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install 'hybridkv[torch]')")
pytest.importorskip("transformers", reason="needs transformers (pip install 'hybridkv[hf]')")

from hybridkv.blockmgr.prefix import PrefixCacheConfig  # noqa: E402
from hybridkv.blockmgr.records import SwapDirection, TierCopies  # noqa: E402
from hybridkv.errors import RequestTooLargeError  # noqa: E402
from hybridkv.integrations.transformers import LLM, SamplingParams  # noqa: E402
from hybridkv.integrations.transformers import engine as engine_module  # noqa: E402
from hybridkv.integrations.transformers.sampling import sample  # noqa: E402

from .hf_serving_fixtures import AlternatingPreemptor, one_thread, pool_blocks, tiny_model  # noqa: E402, F401

PROMPTS = ([5, 6, 7, 8, 9, 10, 11], [3, 1, 4, 1, 5], [9] * 13, [5, 6, 7, 8, 2, 2])


@pytest.fixture(scope="module")
def model():
    return tiny_model("nemotron_h")  # Mamba2 + attention + MLP: KV blocks and state sets


@torch.no_grad()
def hf_alone(model, prompt: list[int], max_new_tokens: int, params: SamplingParams | None = None) -> list[int]:
    """The request alone in HF: one forward over its tokens per generated token, sampled as the engine does."""
    params = params or SamplingParams()
    toks = list(prompt)
    for _ in range(max_new_tokens):
        logits = model(input_ids=torch.tensor([toks])).logits[0, -1].float()
        toks.append(sample(logits, params, len(toks) - 1))
    return toks[len(prompt) :]


def sample_params(params: SamplingParams, i: int) -> SamplingParams:
    """Parallel sample ``i`` of a request (0: the request itself)."""
    return params if i == 0 else params.child(i)


def sample_ids(rid, n: int) -> list:
    return [rid] + [(rid, i) for i in range(1, n)]


# ---- 1. the host tier --------------------------------


def test_the_host_tier_serves_prefixes_evicted_to_the_host_pool(model):
    """Requests that share a prefix, one after another, on a pool too small to keep it: it is offloaded
    to the host pool and hit there (copied back in stage 3b of docs/contract.md); every output equals
    the request alone in HF."""
    tier = PrefixCacheConfig(checkpoint="branch_and_last", host_tier=True)
    llm = LLM(
        model,
        num_blocks=pool_blocks(model, requests=2, kv_blocks=10, k=0),
        block_size=4,
        num_host_blocks=64,
        prefix_cache=tier,
        max_num_seqs=1,
    )
    prefix = [7, 3, 9, 4, 1, 8, 2, 6, 5, 11, 12, 13]
    prompts = {f"p{i}": prefix + [20 + i, 40 + i] for i in range(6)} | {f"o{i}": [60 + i] * 9 for i in range(3)}
    order = ["p0", "p1", "o0", "p2", "o1", "p3", "o2", "p4", "p5"]
    for rid in order:
        llm.add_request(rid, prompts[rid], 3)
    out = llm.run()
    assert out == {rid: hf_alone(model, prompts[rid], 3) for rid in order}
    ev = llm.events
    assert ev.tier_offloaded > 0 and ev.tier_onloaded > 0 and ev.prefix_hit_tokens > 0, ev
    llm.engine.manager.check_integrity()


# ---- 2. n parallel samples ---------------------------------------------------------------------------


@pytest.mark.parametrize("max_new_tokens", [1, 4])
def test_n_samples_give_n_outputs_each_with_its_own_first_token(model, max_new_tokens):
    llm = LLM(model, num_blocks=96, block_size=4, max_num_batched_tokens=16)
    sampled = SamplingParams(temperature=1.0, seed=11, n=4)
    llm.add_request("s", PROMPTS[0], max_new_tokens, sampled)
    llm.add_request("g", PROMPTS[1], max_new_tokens, SamplingParams(n=3))  # greedy: three equal samples
    out = llm.run()
    assert sorted(map(str, out)) == sorted(map(str, sample_ids("s", 4) + sample_ids("g", 3)))
    for i, rid in enumerate(sample_ids("s", 4)):
        assert out[rid] == hf_alone(model, PROMPTS[0], max_new_tokens, sample_params(sampled, i)), rid
    assert len({out[rid][0] for rid in sample_ids("s", 4)}) > 1  # independent first draws, not the parent's
    greedy = hf_alone(model, PROMPTS[1], max_new_tokens)
    assert all(out[rid] == greedy for rid in sample_ids("g", 3))


@pytest.mark.parametrize("limit", ["max_num_seqs", "blocks"])
def test_a_fork_that_does_not_fit_now_waits_for_room(model, limit):
    """A sample whose fork finds no room (no free sequence slot, or no free blocks for its state set)
    waits and runs later: n outputs all the same."""
    if limit == "max_num_seqs":
        llm = LLM(model, num_blocks=96, block_size=4, max_num_seqs=1)
    else:  # room for one request's state set and its KV, not for a second state set
        llm = LLM(model, num_blocks=pool_blocks(model, requests=1, kv_blocks=5, k=0), block_size=4, prefix_cache=None)
    params = SamplingParams(temperature=0.7, seed=5, n=3)
    llm.add_request("a", PROMPTS[0], 6, params)
    out = llm.run()
    assert set(out) == set(sample_ids("a", 3))
    assert llm.events.forks_queued == 2  # neither fork fitted at the branch point: both samples queued
    for i, rid in enumerate(sample_ids("a", 3)):
        assert out[rid] == hf_alone(model, PROMPTS[0], 6, sample_params(params, i)), rid
    llm.engine.manager.check_integrity()


def test_n_samples_that_can_never_fit_are_refused_at_add_request(model):
    llm = LLM(model, num_blocks=pool_blocks(model, requests=1, kv_blocks=5, k=0), block_size=4)
    with pytest.raises(RequestTooLargeError):
        llm.add_request("a", PROMPTS[2], 64, SamplingParams(n=2))
    llm.add_request(("b", 1), PROMPTS[1], 2)
    with pytest.raises(ValueError, match=r"\('b', 1\)"):  # its second sample's id is taken
        llm.add_request("b", PROMPTS[1], 2, SamplingParams(n=2))
    llm.add_request("c", PROMPTS[0], 2, SamplingParams(n=2))
    with pytest.raises(ValueError, match="sample"):  # the id of a sample still to come
        llm.add_request(("c", 1), PROMPTS[0], 2)
    assert set(llm.engine.scheduler.requests) == {("b", 1), "c"}
    greedy = hf_alone(model, PROMPTS[0], 2)
    assert llm.run() == {("b", 1): hf_alone(model, PROMPTS[1], 2), "c": greedy, ("c", 1): greedy}


# ---- 3. a bad request is refused before anything is queued ----------------------------------------


def test_a_bad_request_is_refused_before_anything_is_queued(model):
    llm = LLM(model, num_blocks=64, block_size=4)
    engine = llm.engine
    for bad in ({"temperature": 0.5}, "greedy", 0.7, {}):
        with pytest.raises(TypeError, match="SamplingParams"):
            llm.add_request("a", PROMPTS[0], 4, bad)
    changed = SamplingParams(n=2)
    object.__setattr__(changed, "n", 0)  # (frozen, yet changed): checked again at add_request
    with pytest.raises(ValueError, match="n must be"):
        llm.add_request("a", PROMPTS[0], 4, changed)
    with pytest.raises((TypeError, ValueError), match="seed"):
        SamplingParams(temperature=0.5, seed=1.5)  # would fail inside a step, at its first sample
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("inf"))
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=True)
    for prompt, n in (([], 4), ([1, 500], 4), ([1.5, 2], 4), ("abc", 4), (PROMPTS[0], 0), (PROMPTS[0], 2.5)):
        with pytest.raises((TypeError, ValueError)):
            llm.add_request("a", prompt, n)
    assert not engine.scheduler.requests and not engine.params and not engine.tokens and not engine._forks
    assert engine.manager.usage().used == 0
    llm.add_request("a", PROMPTS[0], 4)  # the id was never taken; the engine serves
    assert llm.run() == {"a": hf_alone(model, PROMPTS[0], 4)}


# ---- 4. an exception inside a step ------------------------------------------------------------------


class Injected(RuntimeError):
    pass


def inject(monkeypatch, obj, name: str, nth: int, when=lambda *a, **kw: True) -> list[int]:
    """``obj.name`` raises :class:`Injected` on its ``nth`` call that ``when`` selects, once."""
    original = getattr(obj, name)
    calls = [0]

    def failing(*a, **kw):
        if when(*a, **kw):
            calls[0] += 1
            if calls[0] == nth:
                raise Injected(f"{name} call {nth}")
        return original(*a, **kw)

    monkeypatch.setattr(obj, name, failing)
    return calls


# (numbers as the scenario runs today: the assertions hold wherever the fault lands)
FAULTS = [
    ("forward", 1),  # the first forward
    ("forward", 26),  # "c" (n = 2) at its first token: the sample it had still to branch fails with it
    ("forward", 31),  # mid-step: one forward of the step ran, its rows' state sets moved
    ("drafter", 5),
    ("copies", 29),  # stage 1 of a plan that carries a fresh fork's state copy and checkpoints
    ("swap", 1),  # a swap-out's copy: the request swapped out fails too
]


@pytest.mark.parametrize("where,nth", FAULTS)
def test_an_exception_in_a_step_aborts_that_steps_requests_and_the_engine_goes_on(model, monkeypatch, where, nth):
    """A fault inside a step (the model's forward, the drafter, a copy): the exception reaches the
    caller, the step's requests are aborted and reported, the books balance, and the next run()
    serves every other request (and new ones) with the tokens HF gives alone."""
    llm = LLM(
        model,
        num_blocks=pool_blocks(model, requests=2, kv_blocks=4),  # small: preemption by swap and recompute
        block_size=4,
        num_host_blocks=32,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        num_speculative_tokens=2,
        prefix_cache=PrefixCacheConfig(checkpoint="branch_and_last", eviction="lru"),
        scheduler_options={"admission": "first_chunk"},
    )
    engine = llm.engine
    engine.scheduler.preemptor = AlternatingPreemptor(engine.manager)
    requests = {
        "a": (PROMPTS[0], 6, SamplingParams()),
        "b": (PROMPTS[1], 5, SamplingParams(temperature=0.9, seed=2)),
        "c": (PROMPTS[2], 4, SamplingParams(n=2)),
        "d": (PROMPTS[3], 7, SamplingParams(temperature=0.8, seed=4, n=3)),
        "e": (PROMPTS[0] + [3, 3], 3, SamplingParams()),
    }
    for rid, (prompt, n, params) in requests.items():
        llm.add_request(rid, prompt, n, params)
    if where == "forward":  # the model's forward (not the drafter's, which has no cache)
        inject(monkeypatch, model, "forward", nth, when=lambda *a, **kw: kw.get("use_cache"))
    elif where == "drafter":
        inject(monkeypatch, engine.drafter, "propose", nth)
    else:
        inject(monkeypatch, engine_module, "copy_blocks" if where == "copies" else "swap_blocks", nth)
    with pytest.raises(Injected) as e:
        llm.run()
    engine.manager.check_integrity()
    monkeypatch.undo()  # (the fault was transient)
    llm.add_request("f", PROMPTS[1], 4)  # the engine takes new work
    out = llm.run()
    engine.manager.check_integrity()
    failed = dict(engine.failed)  # the requests of the step that raised, aborted
    assert failed and all(exc is e.value for exc in failed.values())
    assert "aborted" in "".join(getattr(e.value, "__notes__", ()))
    requests["f"] = (PROMPTS[1], 4, SamplingParams())
    for rid, (prompt, n, params) in requests.items():
        for i, sid in enumerate(sample_ids(rid, params.n)):
            if sid in failed:  # (a sample forked before its parent failed goes on: a request of its own)
                assert sid not in out
                continue
            assert out[sid] == hf_alone(model, prompt, n, sample_params(params, i)), sid
    assert len(out) + len(failed) == sum(p.n for _, _, p in requests.values())
    assert engine.events.failed == len(failed) and len(llm.stats) == engine.events.steps


def test_an_offload_that_raises_leaves_no_unwritten_host_block_to_hit(model, monkeypatch):
    """A fault in the copy of the host tier's offloads (stage 0, device -> host): no host block it was
    to write stays in the tier (a later host hit would copy back bytes nobody wrote), the books
    balance, and the engine goes on: every request served after the fault, host hits included,
    equals the request alone in HF."""
    tier = PrefixCacheConfig(checkpoint="branch_and_last", host_tier=True)
    llm = LLM(
        model,
        num_blocks=pool_blocks(model, requests=2, kv_blocks=10, k=0),
        block_size=4,
        num_host_blocks=64,
        prefix_cache=tier,
        max_num_seqs=1,
    )
    engine = llm.engine
    written: set[int] = set()  # host blocks whose last offload ran
    swap, faults = engine_module.swap_blocks, [1]

    def recording_swap(pools, host, plan, **kw):
        is_tier = isinstance(plan, TierCopies) and len(plan) > 0
        if is_tier and plan.direction is SwapDirection.OUT:
            written.difference_update(plan.host_blocks.tolist())  # (taken by new units: not written yet)
        if is_tier and plan.direction is SwapDirection.OUT and faults[0]:
            faults[0] -= 1
            raise Injected("offload copy")
        out = swap(pools, host, plan, **kw)
        if is_tier and plan.direction is SwapDirection.OUT:
            written.update(plan.host_blocks.tolist())
        return out

    monkeypatch.setattr(engine_module, "swap_blocks", recording_swap)
    prefix = [7, 3, 9, 4, 1, 8, 2, 6, 5, 11, 12, 13]
    prompts = {f"p{i}": prefix + [20 + i, 40 + i] for i in range(9)} | {f"o{i}": [60 + i] * 9 for i in range(5)}
    order = ["p0", "p1", "o0", "p2", "o1", "p3", "o2", "p4", "p5"]
    for rid in order:
        llm.add_request(rid, prompts[rid], 3)

    def host_units() -> set[int]:
        ids = engine.manager.prefix_cache.tier.host_ids()
        return set(np.concatenate(ids).tolist()) if ids else set()

    with pytest.raises(Injected):
        llm.run()
    assert not faults[0]
    assert host_units() <= written, sorted(host_units() - written)  # nothing registered that was never written
    engine.manager.check_integrity()
    out = llm.run()
    for rid in ["o3", "p6", "o4", "p7", "p8"]:  # more host hits on the prefix after the fault
        llm.add_request(rid, prompts[rid], 3)
    out = llm.run()
    assert host_units() <= written
    engine.manager.check_integrity()
    assert llm.events.tier_onloaded > 0 and set(engine.failed)
    for rid, toks in out.items():
        assert toks == hf_alone(model, prompts[rid], 3), rid
    assert set(out) | set(engine.failed) == set(prompts)
