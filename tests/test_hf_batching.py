"""The transformers engine batches what ``generate`` batches, and stays exact: fresh prompts of
different lengths run in one left-padded forward, every decode of a step in one forward.

Oracle, per served family: each request alone in transformers (one forward over its tokens), at
10 x HF's own noise floor. Prompt lengths run from 1 token (shorter than every conv window, so
the state written after a prompt holds pad columns unless the padding mask zeroed them) to 13.
A broken engine that leaves out the recurrent layers' padding mask must miss on every family
with recurrent state (the pads' inputs then move the state).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install 'hybridkv[torch]')")
pytest.importorskip("transformers", reason="needs transformers (pip install 'hybridkv[hf]')")

from hybridkv.integrations.transformers import EngineConfig, HFEngine  # noqa: E402

from .hf_serving_fixtures import FAMILY_CONFIGS, hf_chunked, hf_one_forward, one_thread, tiny_model  # noqa: E402, F401

FAMILIES = sorted(FAMILY_CONFIGS)
LENGTHS = (1, 2, 3, 5, 8, 13, 7)
NEW_TOKENS = 4
_MODELS: dict[str, torch.nn.Module] = {}


def model_of(model_type: str) -> torch.nn.Module:
    """The tiny model with a pad token (id 0, what the engine pads with) whose embedding is not zero,
    as in a trained model (transformers' random init zeroes it): the pads' inputs are then not zero
    unless the padding mask zeroes them."""
    if model_type not in _MODELS:
        model = tiny_model(model_type)
        with torch.no_grad():
            torch.manual_seed(1)
            weight = model.get_input_embeddings().weight
            weight[0].normal_(0.0, float(weight[1:].std()))  # (the scale of the other tokens')
        _MODELS[model_type] = model
    return _MODELS[model_type]


class NoPaddingMask(HFEngine):
    """Broken: the recurrent layers get no padding mask (attention layers still get theirs)."""

    def _mask(self, past, t, pads, real):
        mask = super()._mask(past, t, pads, real)
        if isinstance(mask, dict):
            return {k: (v if k in ("full_attention", "sliding_attention") else None) for k, v in mask.items()}
        return mask if self.cache.kv else None


def serve(model, engine_cls=HFEngine) -> HFEngine:
    # no prefix cache: it would cut the prompts at their last block boundary (checkpoints; see
    # test_tails_of_many_lengths_run_in_binary_parts)
    config = EngineConfig(num_blocks=256, block_size=4, max_num_seqs=8, prefix_cache=None, record_logits=True)
    engine = engine_cls(model, config)
    for i, n in enumerate(LENGTHS):
        engine.add_request(i, [(7 * i + 3 * j) % 120 + 1 for j in range(n)], NEW_TOKENS)
    engine.run()
    return engine


def worst_error(engine: HFEngine, model) -> float:
    worst = 0.0
    for rid, entries in engine.logits.items():
        ref = hf_one_forward(model, engine.tokens[rid])
        worst = max(worst, max(float((lg - ref[pos]).abs().max()) for pos, lg in entries))
    return worst


def tolerance(engine: HFEngine, model) -> float:
    floor = 0.0
    for i, n in enumerate(LENGTHS):
        toks = engine.tokens[i]
        floor = max(floor, float((hf_one_forward(model, toks) - hf_chunked(model, toks, n, n)).abs().max()))
    return max(10 * floor, 1e-6)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_fresh_prompts_of_different_lengths_run_in_one_forward_and_equal_hf_alone(model_type):
    model = model_of(model_type)
    engine = serve(model)
    # step 0: the seven prompts in one forward; then one forward per step for all the decodes
    assert engine.stats[0].num_rows == len(LENGTHS) and engine.stats[0].num_forwards == 1
    assert all(s.num_forwards == 1 for s in engine.stats if s.num_rows), [s.num_forwards for s in engine.stats]
    assert engine.events.forwards == NEW_TOKENS  # as generate: the prompts, then one forward per token
    tol = tolerance(engine, model)
    err = worst_error(engine, model)
    print(f"\n{model_type}: {engine.events.forwards} forwards; worst |logit - HF alone| {err:.2e}, tolerance {tol:.1e}")
    assert err <= tol, f"{model_type}: {err:.3e} > {tol:.3e}"
    # the same requests one by one: the same tokens
    for i, n in enumerate(LENGTHS):
        prompt = engine.tokens[i][:n]
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert out[0, n:].tolist() == engine.tokens[i][n:], i


@pytest.mark.parametrize("model_type", [t for t in FAMILIES if t != "minimax_m2"])  # (no recurrent state)
def test_without_the_padding_mask_the_states_are_wrong(model_type):
    model = model_of(model_type)
    healthy = serve(model)
    tol = tolerance(healthy, model)
    err = worst_error(serve(model, NoPaddingMask), model)
    print(f"\n{model_type}: no padding mask, error / tolerance {err / tol:.0f}x")
    assert err >= 100 * tol, f"{model_type}: left padding without the mask is only {err / tol:.1f}x the tolerance"


# (Jamba and Mamba run a continuing chunk one token per forward; the prefix cache cuts nothing for
# MiniMax-M2, which keeps no state, nor for Mamba2, which keeps no KV)
@pytest.mark.parametrize(
    "model_type", [t for t in FAMILIES if t not in ("jamba", "mamba", "falcon_mamba", "minimax_m2", "mamba2")]
)
def test_tails_of_many_lengths_run_in_binary_parts(model_type):
    """The prefix cache cuts each prompt at its last block boundary (a checkpoint there), so the next
    step continues 15 states by tails of 15 lengths: they run in their binary parts, 4 forwards
    (1, 2, 4, 8 tokens; the one-token parts with the decodes), and equal HF alone."""
    model = model_of(model_type)
    engine = HFEngine(
        model,
        EngineConfig(num_blocks=512, block_size=16, max_num_seqs=16, max_num_batched_tokens=512, record_logits=True),
    )
    for k in range(1, 16):
        engine.add_request(k, [(5 * k + 3 * j) % 120 + 1 for j in range(16 + k)], 3)
    engine.run()
    tails = engine.stats[1]
    assert engine.stats[0].num_forwards == 1 and engine.stats[0].num_tokens == 15 * 16  # the heads, cut
    assert tails.num_rows == 15 and tails.num_tokens == sum(range(1, 16))
    assert tails.num_forwards == 4, [s.num_forwards for s in engine.stats]
    tol = max(10 * max(_floor(model, engine.tokens[k], 16 + k) for k in (1, 7, 15)), 1e-6)
    err = worst_error(engine, model)
    print(f"\n{model_type}: tail step {tails.num_forwards} forwards; worst |logit - HF alone| {err:.2e}")
    assert err <= tol, f"{model_type}: {err:.3e} > {tol:.3e}"


def _floor(model, toks: list[int], n: int) -> float:
    return float((hf_one_forward(model, toks) - hf_chunked(model, toks, n, n)).abs().max())
