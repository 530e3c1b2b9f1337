"""Which transformers model families the runner serves, and what it must know about each one's cache.

A family is served when its modeling code keeps its cache in transformers' ``DynamicCache`` (K/V in
``DynamicLayer``-like layers, recurrent layers in ``LinearAttentionLayer``-like layers with one conv
and / or one recurrent state) or, for MiniMax, in ``MiniMaxCache`` (K/V layers plus ``linear_cache``).
Everything else (which layer holds what, shapes, dtypes) comes from hybridkv's own model description
(:func:`hybridkv.models.hf.spec_from_hf_config`), which the runner checks against the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.errors import HybridKVError


class UnsupportedModelError(HybridKVError, ValueError):
    """The model's family cannot be served through hybridkv's paged state (one line naming it)."""


@dataclass(frozen=True)
class Family:
    """What differs between the served families.

    ``cache``: ``"dynamic"`` (``DynamicCache(config=...)``) or ``"minimax"`` (``MiniMaxCache``).
    ``continues_multi_token``: whether the model's multi-token forward starts from a cached recurrent
    state. The full-sequence scans of Jamba, Mamba and FalconMamba (transformers 5.24) ignore the
    cached SSM state, so a prefill chunk that continues a state runs one token per forward there.
    """

    model_type: str
    cache: str = "dynamic"
    continues_multi_token: bool = True


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("qwen3_next"),
        Family("qwen3_5_text"),
        Family("qwen3_5_moe_text"),
        Family("mamba2"),
        Family("nemotron_h"),
        Family("jamba", continues_multi_token=False),
        Family("minimax", cache="minimax"),
        Family("falcon_h1"),
        Family("granitemoehybrid"),
        Family("bamba"),
        Family("zamba"),
        Family("zamba2"),
        Family("olmo_hybrid"),
        Family("mamba", continues_multi_token=False),
        Family("falcon_mamba", continues_multi_token=False),
        Family("lfm2"),
        Family("lfm2_moe"),
        Family("kimi_linear"),
        Family("bailing_hybrid"),
        Family("minimax_m2"),
    )
}


def family_of(model_type: str) -> Family:
    """The :class:`Family` of ``model_type``; raises :class:`UnsupportedModelError` naming it."""
    fam = FAMILIES.get(str(model_type))
    if fam is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} cannot be served by hybridkv.integrations.transformers: it serves "
            f"{', '.join(sorted(FAMILIES))} (hybridkv.models may still describe it for planning)"
        )
    return fam
