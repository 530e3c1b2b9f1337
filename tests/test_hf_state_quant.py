"""The transformers engine with a quantized state dtype (EngineConfig.state_dtype): the model computes
in float32 as before, hybridkv stores its recurrent states int8 / fp8 (with row scales) or float16 in
the pool; logits stay near the float32-state run and the pool holds the narrow bytes."""

from __future__ import annotations

import pytest
import torch

from hybridkv.integrations.transformers.engine import EngineConfig, HFEngine
from hybridkv.integrations.transformers.sampling import SamplingParams
from tests.hf_serving_fixtures import tiny_model


def _run(model, state_dtype):
    config = EngineConfig(num_blocks=256, block_size=4, max_num_seqs=2, record_logits=True, state_dtype=state_dtype)
    engine = HFEngine(model, config)
    for i, prompt in enumerate(([5, 9, 17, 33, 2, 71, 8, 40, 3], [1, 2, 3, 4, 5, 6, 7])):
        engine.add_request(i, prompt, 12, SamplingParams(temperature=0.0))
    engine.run()
    logits = torch.stack([lg for r in (0, 1) for _, lg in engine.logits[r]])
    return engine, logits


@pytest.mark.parametrize("model_type", ["mamba2", "qwen3_5_text"])
def test_quantized_state_serves_near_the_float32_state(model_type):
    torch.set_num_threads(1)
    model = tiny_model(model_type)
    _, ref = _run(model, None)
    same, logits32 = _run(model, "float32")
    assert torch.equal(logits32, ref)
    scale = ref.abs().max()
    errors = {}
    for dtype in ("float16", "int8", "fp8"):
        engine, got = _run(model, dtype)
        comps = [c for _, r in engine.layout.model.recurrent_layers() for c in r.components]
        main = [c for c in comps if not c.name.startswith("conv")]
        assert main and all(c.dtype.value.startswith(dtype[:3]) or dtype == "fp8" for c in main)
        assert all(c.scales == "row" for c in main if c.dtype.quantized)
        assert engine.layout.model.state_bytes < same.layout.model.state_bytes
        assert torch.isfinite(got).all()
        errors[dtype] = float((got - ref).abs().max() / scale)
        assert 0 < errors[dtype] < 0.2, (dtype, errors[dtype])
    assert errors["float16"] < errors["int8"]


def test_the_next_forward_reads_the_stored_state_not_the_buffers():
    """Consecutive forwards of one batch read the state as the pool stores it (quantized), not the
    float32 values the model left in the buffers: a prompt prefilled in chunks of 4 sees int8 error
    from its second chunk on, none in its first."""
    torch.set_num_threads(1)
    model = tiny_model("mamba2")
    logits = []
    for dtype in (None, "int8"):
        config = EngineConfig(
            num_blocks=256, block_size=4, max_num_seqs=1, max_num_batched_tokens=4, record_logits=True,
            prefix_cache=None, state_dtype=dtype,
        )  # fmt: skip
        engine = HFEngine(model, config)
        engine.add_request(0, list(range(3, 15)), 2, SamplingParams(temperature=0.0))
        engine.run()
        logits.append(torch.stack([lg for _, lg in sorted(engine.logits[0], key=lambda e: e[0])]))
    diff = (logits[1] - logits[0]).abs().amax(dim=1)
    assert (diff[:4] == 0).all() and (diff[4:12] > 0).all()


@pytest.mark.parametrize("dtype", ["float16", "int8", "fp8"])
def test_a_narrow_state_keeps_batched_rows_apart(dtype):
    """Rows batched in one forward, their states stored narrow: row 0's logits are bit for bit the same
    whatever row 1's prompt (a dense model on one thread computes each row of a batch alone, so any
    difference is something of row 1 leaking into row 0: a scale, a set, a buffer row)."""
    torch.set_num_threads(1)
    model = tiny_model("qwen3_5_text")
    runs = []
    for other in ([1, 2, 3, 4, 5, 6, 7], [90, 4, 61, 17, 28, 3, 55]):
        config = EngineConfig(
            num_blocks=256, block_size=4, max_num_seqs=2, record_logits=True, prefix_cache=None, state_dtype=dtype
        )
        engine = HFEngine(model, config)
        for i, prompt in enumerate(([5, 9, 17, 33, 2, 71, 8, 40, 3], other)):
            engine.add_request(i, prompt, 12, SamplingParams(temperature=0.0))
        engine.run()
        assert engine.events.forwards == engine.events.steps  # both rows in every forward
        runs.append(torch.stack([lg for _, lg in sorted(engine.logits[0], key=lambda e: e[0])]))
    assert runs[0].shape[0] == 9 + 11 and torch.equal(runs[0], runs[1])
