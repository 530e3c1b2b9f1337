"""ZAYA (``model_type`` ``zaya``): every layer is ``hybrid`` or ``hybrid_sliding`` (``layer_types``,
default all ``hybrid``). Its attention (CCA) computes q and k through two stacked causal convolutions
(``cca_time0``, ``cca_time1`` taps) and half of each value head from the previous token, so besides
K/V each layer keeps

- ``qk_window [(num_attention_heads + num_key_value_heads) * head_dim, cca_time0 + cca_time1 - 2]``:
  the q/k inputs the two convolutions still need (transformers' conv state; exactly the columns a
  step reads, so not widened by :func:`~hybridkv.models.spec.with_conv_columns`);
- ``v_prev [num_key_value_heads * head_dim / 2]``: the previous token's delayed value projection;

both in the model dtype (the activations transformers copies in). A ``hybrid`` layer keeps all of
K/V (a :class:`HybridLayerSpec`); a ``hybrid_sliding`` layer keeps the K/V of its last
``sliding_window - 1`` tokens, so its whole cache is a fixed-size state. Tensor parallelism splits
both components by heads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.errors import SpecError
from hybridkv.models.fields import _field
from hybridkv.models.hf.common import Dtypes, _hf_attention, _num_layers, expand, pattern_from, window_of, with_window
from hybridkv.models.spec import HybridLayerSpec, LayerSpec, RecurrentLayerSpec, StateComponent

MODEL_TYPES = ("zaya",)


def read(cfg: Mapping[str, Any], where: str, dt: Dtypes) -> tuple[LayerSpec, ...]:
    """The layers of a ZAYA config."""
    n = _num_layers(cfg, where)
    pattern = pattern_from(cfg, where, ("layer_types",), "HS", n) or "H" * n
    attn = _hf_attention(cfg, where, dt)
    q, kv, hd = attn.num_q_heads or attn.num_kv_heads, attn.num_kv_heads, attn.head_dim
    taps = _field(cfg, "cca_time0", where, default=2) + _field(cfg, "cca_time1", where, default=2) - 2
    if taps < 1 or kv * hd % 2:
        raise SpecError(f"{where}: cca_time0 + cca_time1 must be at least 3 and kv heads x head_dim even")
    cca = RecurrentLayerSpec(
        "cca",
        (
            StateComponent("qk_window", ((q + kv) * hd, taps), dt.conv("cca"), 0, tp_heads=(q, kv)),
            StateComponent("v_prev", (kv * hd // 2,), dt.fixed("cca", "v_prev", dt.model, dt.model_source), 0),
        ),
    )
    specs: dict[str, LayerSpec] = {"H": HybridLayerSpec(attn, cca)}
    if "S" in pattern:
        specs["S"] = with_window(cca, attn, window_of(cfg, where, dt), where)
    return expand(pattern, specs, where)
