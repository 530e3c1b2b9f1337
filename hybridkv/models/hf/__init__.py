"""Model specs from HuggingFace ``config.json`` files: one reader module per family.

Each family module has ``read(cfg, where, state_dtype) -> (pattern, attention layer, recurrent
layer)``; :func:`spec_from_hf_config` picks it by ``model_type`` (:data:`READERS`) and builds the
:class:`~hybridkv.models.spec.ModelSpec`. Adding a family is a new module here and a line in
:data:`READERS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hybridkv.errors import SpecError
from hybridkv.models import presets as P
from hybridkv.models.fields import _dtype, _table, _whole
from hybridkv.models.hf import jamba, mamba2, minimax, nemotron_h, qwen3_next
from hybridkv.models.spec import DType, ModelSpec

# model_type -> reader; a key ending in "*" matches every model_type it starts
READERS: dict[str, Callable[..., tuple]] = {
    "minimax*": minimax.read,
    "qwen3_next": qwen3_next.read,
    "nemotron_h": nemotron_h.read,
    "jamba": jamba.read,
    "mamba2": mamba2.read,
}


def _reader(model_type: str) -> Callable[..., tuple] | None:
    for key, read in READERS.items():
        if model_type == key or (key.endswith("*") and model_type.startswith(key[:-1])):
            return read
    return None


def spec_from_hf_config(
    cfg: Mapping[str, Any], source: str = "config.json", state_dtype: DType | str | None = None
) -> ModelSpec:
    """A spec from a HuggingFace ``config.json`` of MiniMax-M1/Text-01, Qwen3-Next, Nemotron-H, Jamba or Mamba2.

    Raises :class:`SpecError` for an unsupported ``model_type`` or a missing / malformed field.
    """
    cfg = _table(cfg, source)
    mt = str(cfg.get("model_type", "")).lower()
    where = f"{source} (model_type {mt!r})"
    name = cfg.get("_name_or_path") or mt or Path(source).stem
    name = name if isinstance(name, str) else str(mt or Path(source).stem)
    dt = _dtype(state_dtype, where) if state_dtype else None
    try:
        read = _reader(mt)
        if read is None:
            raise SpecError(
                f"{source}: HuggingFace model_type {mt!r} is not understood; supported: "
                f"{', '.join(READERS)} - or write a hybridkv spec file"
            )
        pattern, attn, rec = read(cfg, where, dt)
        hidden = cfg.get("hidden_size")
        return ModelSpec(
            name,
            P.layers_from_pattern(pattern, attn, rec),
            hidden_size=None if hidden is None else _whole(hidden, where, "hidden_size"),
        )
    except SpecError as e:
        msg = str(e)
        raise SpecError(msg if msg.startswith(source) else f"{where}: {msg}") from None
