"""Model specs from HuggingFace ``config.json`` files: one reader module per family.

Each family module has ``MODEL_TYPES`` and ``read(cfg, where, dtypes) -> layers`` (one layer spec per
decoder layer, or a :class:`~hybridkv.models.hf.common.ReadOut` when a decoder layer keeps several
caches; ``dtypes`` is a :class:`~hybridkv.models.hf.common.Dtypes` that records where each
dtype came from). :func:`spec_from_hf_config` picks the reader by ``model_type`` (:data:`READERS`),
reads a composite config's ``text_config`` when the outer type has no reader of its own, and builds
the :class:`~hybridkv.models.spec.ModelSpec`. Adding a family is a new module here and its
``MODEL_TYPES`` in :data:`FAMILIES`.

Every hybrid or recurrent ``model_type`` of transformers 5.24 either has a reader or is listed in
:data:`NOT_DESCRIBED` with the reason its cache is not a layout hybridkv describes; any other
``model_type`` is refused with one line naming it (and the per-layer cache kinds its config
declares), never guessed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hybridkv.errors import SpecError
from hybridkv.models.fields import _dtype, _table, _whole
from hybridkv.models.hf import (
    bailing_hybrid,
    bamba,
    dory,
    falcon_h1,
    glm5_next,
    granitemoehybrid,
    inkling,
    jamba,
    kimi_linear,
    lfm2,
    mamba,
    mamba2,
    minimax,
    minimax_m2,
    nemotron_h,
    qwen3_next,
    qwen4_exp,
    recurrent_gemma,
    rwkv,
    xlstm,
    zamba,
    zamba2,
    zaya,
)
from hybridkv.models.hf.common import Dtypes, ReadOut
from hybridkv.models.spec import DType, ModelSpec

FAMILIES = (
    minimax,
    minimax_m2,
    qwen3_next,
    qwen4_exp,
    nemotron_h,
    jamba,
    mamba,
    mamba2,
    bamba,
    granitemoehybrid,
    falcon_h1,
    zamba2,
    zamba,
    lfm2,
    kimi_linear,
    glm5_next,
    bailing_hybrid,
    rwkv,
    xlstm,
    recurrent_gemma,
    dory,
    zaya,
    inkling,
)
READERS: dict[str, Callable[..., tuple]] = {mt: fam.read for fam in FAMILIES for mt in fam.MODEL_TYPES}
"""model_type -> reader."""

NOT_DESCRIBED: dict[str, str] = {
    "lfm3_vl_vision": "a vision encoder (its conv layers run once per image), not a decoder with a per-request cache",
}
"""model_type -> why hybridkv does not read it (one line each)."""

FLAT_TEXT = {"glm5_next": "glm5_next_text"}
"""Composite model_type -> its text model_type, for configs that keep the text fields at the top level."""

_CACHE_KEYS = ("layer_types", "layers_block_type", "block_types", "attn_type_list", "hybrid_override_pattern")


def _refusal(mt: str, cfg: Mapping[str, Any], source: str) -> SpecError:
    if mt in NOT_DESCRIBED:
        return SpecError(f"{source}: HuggingFace model_type {mt!r} is not read: {NOT_DESCRIBED[mt]}")
    text = cfg.get("text_config")
    inner = str(text.get("model_type", "")).lower() if isinstance(text, Mapping) else ""
    if inner in NOT_DESCRIBED:
        return SpecError(
            f"{source}: HuggingFace model_type {mt!r} (text model {inner!r}) is not read: {NOT_DESCRIBED[inner]}"
        )
    declared = ""
    for key in _CACHE_KEYS:
        value = cfg.get(key)
        if isinstance(value, list | tuple):
            kinds = sorted({str(v) for v in value})[:6]
            declared = f" (its {key} names {kinds})"
            break
    return SpecError(
        f"{source}: HuggingFace model_type {mt!r} is not understood{declared}; hybridkv reads "
        f"{', '.join(sorted(READERS))} - for another model write a hybridkv spec file"
    )


def spec_from_hf_config(
    cfg: Mapping[str, Any],
    source: str = "config.json",
    state_dtype: DType | str | None = None,
    conv_dtype: DType | str | None = None,
) -> ModelSpec:
    """A spec from a HuggingFace ``config.json`` (as transformers writes it or as the hub holds it).

    Dtypes: ``state_dtype`` / ``conv_dtype`` when given; else the config's own keys
    (``mamba_ssm_cache_dtype``, ``dtype`` / ``torch_dtype``); else what transformers keeps (SSM and
    delta-net states float32, lightning in the activation dtype, conv and KV in the model dtype). The
    spec's ``dtype_sources`` say which. Raises :class:`SpecError` (one line naming the file and the
    model_type or field) for a model_type without a reader or a missing / malformed field.
    """
    cfg = _table(cfg, source)
    mt = str(cfg.get("model_type", "")).lower()
    text = cfg.get("text_config")
    if mt in FLAT_TEXT and text is None:  # a flat (text-only) checkpoint: transformers reads it as the text config
        cfg, mt = {**cfg, "model_type": FLAT_TEXT[mt]}, FLAT_TEXT[mt]
    if mt not in READERS and isinstance(text, Mapping) and str(text.get("model_type", "")).lower() in READERS:
        inner = dict(text)
        for key in ("dtype", "torch_dtype"):
            inner.setdefault(key, cfg.get(key))
        return spec_from_hf_config(
            {**inner, "_name_or_path": cfg.get("_name_or_path")}, f"{source} text_config", state_dtype, conv_dtype
        )
    where = f"{source} (model_type {mt!r})"
    name = cfg.get("_name_or_path") or mt or Path(source).stem
    name = name if isinstance(name, str) else str(mt or Path(source).stem)
    try:
        read = READERS.get(mt)
        if read is None:
            raise _refusal(mt, cfg, source)
        dt = Dtypes(
            cfg,
            where,
            _dtype(state_dtype, where) if state_dtype else None,
            _dtype(conv_dtype, where) if conv_dtype else None,
        )
        out = read(cfg, where, dt)
        layers, ids = (out.layers, out.decoder_layer_ids) if isinstance(out, ReadOut) else (out, None)
        hidden = cfg.get("hidden_size")
        return ModelSpec(
            name,
            tuple(layers),
            hidden_size=None if hidden is None else _whole(hidden, where, "hidden_size"),
            dtype_sources=tuple(dt.sources.items()),
            decoder_layer_ids=ids,
        )
    except SpecError as e:
        msg = str(e)
        raise SpecError(msg if msg.startswith(source) else f"{where}: {msg}") from None
