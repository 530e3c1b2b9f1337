"""The five-line API of hybridkv.integrations.transformers, its input checks, sampling and drafting.

Oracle for the outputs: transformers' ``generate`` on the same unmodified model (bf16 here, so the
pool keeps each state in the dtype transformers' own code keeps: SSM fp32, conv bf16).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install 'hybridkv[torch]')")
transformers = pytest.importorskip("transformers", reason="needs transformers (pip install 'hybridkv[hf]')")

from hybridkv.blockmgr.prefix import PrefixCacheConfig  # noqa: E402
from hybridkv.integrations.transformers import (  # noqa: E402
    LLM,
    EngineConfig,
    HFEngine,
    NgramDrafter,
    SamplingParams,
    UnsupportedModelError,
)
from hybridkv.integrations.transformers.paged_cache import _same_dtype, attention_mask  # noqa: E402
from hybridkv.integrations.transformers.sampling import sample  # noqa: E402

from .hf_serving_fixtures import FAMILY_CONFIGS, one_thread, tiny_model  # noqa: E402, F401


def _bf16(model_type: str):
    cfg = transformers.CONFIG_MAPPING[model_type](pad_token_id=0, **FAMILY_CONFIGS[model_type])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    return model


def test_five_lines_serve_a_bf16_model_as_hf_generate_does():
    model = _bf16("nemotron_h")
    llm = LLM(model, num_blocks=64, block_size=4, max_num_batched_tokens=8)
    for i, prompt in enumerate(([5, 6, 7, 8, 9, 10, 11], [3, 1, 4, 1, 5], [9] * 13)):
        llm.add_request(i, prompt, 6)
    outputs = llm.run()
    for i, prompt in enumerate(([5, 6, 7, 8, 9, 10, 11], [3, 1, 4, 1, 5], [9] * 13)):
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt) :]
        assert outputs[i] == ref.tolist()
    assert len(llm.stats) == llm.events.steps and sum(s.num_finished for s in llm.stats) == 3
    assert max(s.num_rows for s in llm.stats) > 1  # batched
    dtypes = llm.engine.cache.state_dtypes()[0]
    assert dtypes == {"ssm": torch.float32, "conv": torch.bfloat16}  # what NemotronH keeps (tests/test_models_hf.py)


def test_seeded_sampling_is_a_function_of_seed_and_position():
    logits = torch.randn(50)
    p = SamplingParams(temperature=1.0, seed=3)
    assert sample(logits, p, 7) == sample(logits.clone(), p, 7)
    assert len({sample(logits, p, pos) for pos in range(40)}) > 1  # not argmax
    assert sample(logits, SamplingParams(), 7) == int(logits.argmax())
    assert p.child(1).seed != p.child(2).seed and p.child(1).n == 1
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)


def test_ngram_drafter_proposes_what_followed_the_last_ngram():
    d = NgramDrafter(max_n=3)
    assert d.propose("r", [1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]
    assert d.propose("r", [4, 5, 6], 2) == []
    assert d.propose("r", [7, 8, 7], 3) == [8, 7]


def test_attention_mask_hides_the_padding_of_shorter_pasts():
    m = attention_mask([2, 0], 2, torch.float32)[:, 0]  # [B, T, P + T], P = 2
    allowed = m == 0
    assert allowed[0].tolist() == [[True, True, True, False], [True, True, True, True]]
    assert allowed[1].tolist() == [[False, False, True, False], [False, False, True, True]]


def test_bad_input_is_refused_before_any_work():
    model = tiny_model("mamba2")
    with pytest.raises(TypeError, match="unknown LLM options"):
        LLM(model, num_blokcs=8)
    with pytest.raises(ValueError, match="needs a drafter"):
        HFEngine(model, EngineConfig(num_speculative_tokens=2))
    exporting = PrefixCacheConfig("vllm_align", export_alignment=64)  # a kernel's export inside a chunk
    with pytest.raises(ValueError, match="export_alignment"):
        HFEngine(model, EngineConfig(prefix_cache=exporting))
    with pytest.raises(ValueError, match="num_blocks must be a positive integer"):
        EngineConfig(num_blocks=0)
    llm = LLM(model, num_blocks=32)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.add_request("a", [1, 500], 2)
    assert not llm.engine.scheduler.requests  # nothing was queued
    with pytest.raises(UnsupportedModelError, match="MiniMax only"):
        LLM(model, num_blocks=32, lightning_backend="naive")
    cfg = transformers.CONFIG_MAPPING["minimax"](pad_token_id=0, **dict(FAMILY_CONFIGS["minimax"], sliding_window=8))
    with pytest.raises(UnsupportedModelError, match="sliding"):
        HFEngine(transformers.AutoModelForCausalLM.from_config(cfg))


def test_a_state_in_another_dtype_than_the_description_is_refused():
    with pytest.raises(UnsupportedModelError, match="bfloat16.*float32|disagree"):
        _same_dtype(torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.float32), 3)
