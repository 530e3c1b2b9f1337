"""What the transformers engine refuses before any work: settings it cannot serve, pools that can never
hold a request, prompts that are not token ids, requests longer than the model takes.

Every message names what was asked, what was there and which argument of ``LLM`` / ``EngineConfig``
(``num_blocks``, ``block_size``, ``num_speculative_tokens``) or of ``add_request`` (``prompt``,
``max_new_tokens``) to change.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hybridkv.blockmgr.prefix import PrefixCacheConfig
from hybridkv.errors import RequestTooLargeError
from hybridkv.units import is_integer


def check_prefix_cache(prefix_cache: PrefixCacheConfig | None) -> None:
    """The prefix-cache settings the engine cannot serve, refused before any work."""
    if prefix_cache is None:
        return
    if prefix_cache.export_alignment is not None:
        raise ValueError(
            "PrefixCacheConfig.export_alignment needs a prefill kernel that writes the state from inside "
            "a chunk (StepPlan.exports); transformers' forward cannot: leave it None"
        )


def too_large(
    what: str, err: RequestTooLargeError, num_blocks: int, num_speculative_tokens: int, request: bool = True
) -> RequestTooLargeError:
    """``err`` (the manager's: needed and usable blocks) reworded with the engine's own arguments
    (``request``: a request was asked for, so fewer tokens is a way out too)."""
    unusable = num_blocks - err.total  # the null block and the watermark
    out = RequestTooLargeError(err.needed, err.total)
    spec = f" and {num_speculative_tokens} speculative state sets" if num_speculative_tokens else ""
    out.args = (
        f"{what} needs {err.needed} blocks (its KV{spec} included), the pool has {err.total} usable "
        f"(num_blocks={num_blocks}): raise num_blocks to at least {err.needed + unusable}"
        + (", or ask for fewer tokens (prompt, max_new_tokens)" if request else "")
        + (", or lower num_speculative_tokens" if num_speculative_tokens else ""),
    )
    return out


def prompt_token_ids(request_id: Any, prompt: object, vocab_size: int) -> list[int]:
    """``prompt`` as a list of Python ints in ``0..vocab_size-1``. A list / tuple of ints, a 1-D integer
    numpy array or torch tensor pass; ``TypeError`` in words for text, a bare number, a batch (2-D),
    floats and bools; ``ValueError`` for ids outside the vocabulary or an empty prompt."""
    who = f"request {request_id!r}"
    if isinstance(prompt, (str, bytes, bytearray)):
        raise TypeError(
            f"{who}: prompt must be token ids (a list of ints), got {type(prompt).__name__} {prompt[:40]!r}: "
            "tokenize it first (tokenizer(text).input_ids)"
        )
    if isinstance(prompt, (torch.Tensor, np.ndarray)):
        if prompt.ndim != 1:
            raise TypeError(
                f"{who}: prompt must be one sequence of token ids (1-D), got a {type(prompt).__name__} of shape "
                f"{tuple(prompt.shape)}: pass one row (prompt[0]) per request"
            )
        integral = (
            not prompt.is_floating_point() and not prompt.is_complex() and prompt.dtype != torch.bool
            if isinstance(prompt, torch.Tensor)
            else prompt.dtype.kind in "iu"
        )
        if not integral:
            raise TypeError(f"{who}: prompt must be integer token ids, got a {type(prompt).__name__} of {prompt.dtype}")
        prompt = prompt.tolist()
    if is_integer(prompt) or isinstance(prompt, (bool, float)):
        raise TypeError(
            f"{who}: prompt must be a sequence of token ids, got the single {type(prompt).__name__} "
            f"{prompt!r}: pass [{prompt!r}] for a one-token prompt"
        )
    try:
        ids = list(prompt)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"{who}: prompt must be a sequence of token ids, got {type(prompt).__name__}") from None
    for i, t in enumerate(ids):
        if not is_integer(t):
            raise TypeError(f"{who}: prompt must be integer token ids, got {t!r} ({type(t).__name__}) at index {i}")
    ids = [int(t) for t in ids]
    if not ids:
        raise ValueError(f"{who}: the prompt is empty: give at least one token id")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{who}: token ids {bad[:3]} outside the vocabulary 0..{vocab_size - 1}")
    return ids


def max_positions(model_config: Any) -> int | None:
    """The longest sequence the model takes (``max_position_embeddings``), None where it has no limit
    (a model without position embeddings, e.g. Mamba)."""
    n = getattr(model_config, "max_position_embeddings", None)
    return int(n) if is_integer(n) and n > 0 else None


def check_length(request_id: Any, num_prompt: int, max_new_tokens: object, limit: int | None) -> None:
    """``ValueError`` when ``num_prompt + max_new_tokens`` exceeds the model's ``limit`` (a bad
    ``max_new_tokens`` itself is left to the scheduler's check, which names it)."""
    if limit is None or not is_integer(max_new_tokens):
        return
    total = num_prompt + int(max_new_tokens)  # type: ignore[call-overload]
    if total > limit:
        raise ValueError(
            f"request {request_id!r}: {num_prompt} prompt + {max_new_tokens} new tokens = {total} exceed the model's "
            f"max_position_embeddings={limit}: shorten the prompt or lower max_new_tokens "
            + (
                f"(at most {limit - num_prompt} for this prompt)"
                if num_prompt < limit
                else "(the prompt alone is too long)"
            )
        )
