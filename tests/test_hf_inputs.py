"""What the transformers engine refuses before any work, in words that name what to change: requests
longer than the model takes, requests or pools that can never fit, prompts that are not token ids,
temperatures that are not finite.

Oracle for what it accepts: the same unmodified tiny model alone in transformers (``generate``).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install 'hybridkv[torch]')")
transformers = pytest.importorskip("transformers", reason="needs transformers (pip install 'hybridkv[hf]')")

from hybridkv.errors import RequestTooLargeError  # noqa: E402
from hybridkv.integrations.transformers import LLM, SamplingParams  # noqa: E402
from hybridkv.integrations.transformers import engine as engine_module  # noqa: E402

from .hf_serving_fixtures import FAMILY_CONFIGS, one_thread, pool_blocks, tiny_model  # noqa: E402, F401


@pytest.fixture(scope="module")
def model():
    return tiny_model("nemotron_h")


def greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def test_a_request_longer_than_the_model_takes_is_refused_at_add_request():
    cfg = transformers.CONFIG_MAPPING["nemotron_h"](
        pad_token_id=0, **(FAMILY_CONFIGS["nemotron_h"] | {"max_position_embeddings": 24})
    )
    torch.manual_seed(0)
    short = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    short.generation_config.eos_token_id = None
    llm = LLM(short, num_blocks=64, block_size=4)
    prompt = list(range(1, 21))
    with pytest.raises(
        ValueError, match=r"20 prompt \+ 5 new tokens = 25 exceed the model's max_position_embeddings=24"
    ):
        llm.add_request("long", prompt, 5)
    with pytest.raises(ValueError, match="lower max_new_tokens .at most 4 for this prompt"):
        llm.add_request("long", prompt, 5)
    assert not llm.engine.scheduler.requests and not llm.engine.tokens  # nothing queued
    llm.add_request("fits", prompt, 4)  # exactly the model's length
    assert llm.run() == {"fits": greedy(short, prompt, 4)}


def test_a_request_too_large_for_the_pool_names_what_llm_takes(model):
    llm = LLM(model, num_blocks=pool_blocks(model, requests=1, kv_blocks=4, k=0), block_size=4)
    with pytest.raises(RequestTooLargeError) as e:
        llm.add_request("big", list(range(1, 60)), 8)
    msg = str(e.value)
    assert "max_model_len" not in msg  # LLM has no such argument
    assert "raise num_blocks to at least" in msg and "request 'big' (59 prompt + 8 new tokens)" in msg
    needed = int(msg.split("raise num_blocks to at least ")[1].split(",")[0])
    assert not llm.engine.scheduler.requests
    # the figure it gives is the one that serves it
    big = LLM(model, num_blocks=needed, block_size=4)
    big.add_request("big", list(range(1, 60)), 8)
    assert big.run() == {"big": greedy(model, list(range(1, 60)), 8)}


def test_a_pool_that_can_never_hold_one_request_with_its_speculative_sets_is_refused_at_construction(
    model, monkeypatch
):
    with monkeypatch.context() as m:  # refused before any pool is allocated
        m.setattr(engine_module, "allocate_pools", lambda *a, **kw: pytest.fail("a pool was allocated"))
        with pytest.raises(RequestTooLargeError, match="the pool can never hold one request") as e:
            LLM(model, num_blocks=8, block_size=4, num_speculative_tokens=3)
    msg = str(e.value)
    assert "num_blocks=8" in msg and "lower num_speculative_tokens" in msg and "max_model_len" not in msg
    needed = int(msg.split("raise num_blocks to at least ")[1].split(",")[0])
    with pytest.raises(RequestTooLargeError):
        LLM(model, num_blocks=needed - 1, block_size=4, num_speculative_tokens=3)
    llm = LLM(model, num_blocks=needed, block_size=4, num_speculative_tokens=3)  # the smallest that serves
    llm.add_request("a", [7], 1)
    assert llm.run() == {"a": greedy(model, [7], 1)}


@pytest.mark.parametrize(
    ("prompt", "words"),
    [
        ("hello world", "tokenize it first"),
        (b"hello", "tokenize it first"),
        (5, r"pass \[5\] for a one-token prompt"),
        (5.0, "got the single float"),
        ([1.5, 2.0], r"integer token ids, got 1.5 \(float\) at index 0"),
        ([3, True], r"integer token ids, got True \(bool\) at index 1"),
        ([3, None], "at index 1"),
        (np.array([1.0, 2.0]), "integer token ids, got a ndarray of float64"),
        (torch.tensor([[1, 2, 3]]), r"one sequence of token ids \(1-D\), got a Tensor of shape \(1, 3\)"),
        (torch.tensor([1.0, 2.0]), "integer token ids, got a Tensor of torch.float32"),
        ({"input_ids": [1, 2]}, "integer token ids, got 'input_ids'"),
    ],
)
def test_a_prompt_that_is_not_token_ids_is_refused_in_words(model, prompt, words):
    llm = LLM(model, num_blocks=64, block_size=4)
    with pytest.raises(TypeError, match=words):
        llm.add_request("a", prompt, 3)
    assert not llm.engine.scheduler.requests and not llm.engine.tokens and not llm.engine.params


def test_a_one_row_integer_tensor_or_array_is_a_prompt(model):
    llm = LLM(model, num_blocks=64, block_size=4)
    llm.add_request("t", torch.tensor([5, 6, 7, 8]), 3)
    llm.add_request("a", np.array([3, 1, 4], dtype=np.int32), 3)
    assert llm.run() == {"t": greedy(model, [5, 6, 7, 8], 3), "a": greedy(model, [3, 1, 4], 3)}


@pytest.mark.parametrize("temperature", [float("inf"), float("nan"), -0.5, np.float64("inf")])
def test_only_finite_temperatures(model, temperature):
    with pytest.raises(ValueError, match="temperature must be finite and >= 0"):
        SamplingParams(temperature=temperature)
    llm = LLM(model, num_blocks=64, block_size=4)
    params = SamplingParams(temperature=1.0)
    object.__setattr__(params, "temperature", temperature)  # changed behind the frozen dataclass
    with pytest.raises(ValueError, match="temperature"):
        llm.add_request("a", [1, 2], 3, params)
    assert not llm.engine.scheduler.requests
