"""Model specs from files: hybridkv's own JSON/TOML format and HuggingFace ``config.json`` files.

hybridkv format (JSON or TOML), either a ``pattern`` with one attention and one recurrent layer::

    name = "my-hybrid"
    pattern = "RRRA RRRA"          # A/* attention, R/M recurrent, -/E no cache; spaces ignored
    [attention]
    num_kv_heads = 8
    head_dim = 128
    dtype = "bfloat16"
    [recurrent]
    mixer = "mamba2"               # a builder: lightning, mamba, mamba2, gdn, rwkv, gla, retention
    num_heads = 64                 # ... with that builder's arguments
    head_dim = 64
    d_state = 128
    n_groups = 8
    conv_kernel = 4

or a ``layers`` list of such tables, each with ``kind = "attention" | "recurrent" | "none"``.
A recurrent table may list ``components = [{name, shape, dtype, tp_axis}]`` instead of a builder.
"""

from __future__ import annotations

import inspect
import json
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hybridkv.blockmgr import presets as P
from hybridkv.blockmgr.errors import SpecError
from hybridkv.blockmgr.spec import (
    AttentionLayerSpec,
    DType,
    LayerSpec,
    ModelSpec,
    NoCacheLayerSpec,
    RecurrentLayerSpec,
    StateComponent,
)

_BUILDERS: dict[str, Callable[..., RecurrentLayerSpec]] = {
    "lightning": P.lightning_layer,
    "mamba": P.mamba1_layer,
    "mamba2": P.mamba2_layer,
    "gdn": P.gdn_layer,
    "rwkv": P.rwkv_layer,
    "gla": P.gla_layer,
    "retention": P.retention_layer,
}


def _attention(table: Mapping[str, Any], where: str) -> AttentionLayerSpec:
    allowed = {"num_kv_heads", "head_dim", "dtype", "num_q_heads", "kind"}
    extra = set(table) - allowed
    if extra:
        raise SpecError(f"{where}: unknown attention keys {sorted(extra)}; allowed: {sorted(allowed - {'kind'})}")
    try:
        return AttentionLayerSpec(
            int(table["num_kv_heads"]),
            int(table["head_dim"]),
            DType.parse(table.get("dtype", "bfloat16")),
            table.get("num_q_heads"),
        )
    except KeyError as e:
        raise SpecError(f"{where}: attention needs {e.args[0]!r}") from None


def _recurrent(table: Mapping[str, Any], where: str) -> RecurrentLayerSpec:
    args = {k: v for k, v in table.items() if k not in ("kind", "mixer", "components")}
    mixer = table.get("mixer")
    if "components" in table:
        comps = []
        for c in table["components"]:
            try:
                comps.append(
                    StateComponent(
                        c["name"], tuple(c["shape"]), DType.parse(c.get("dtype", "bfloat16")), c.get("tp_axis", 0)
                    )
                )
            except KeyError as e:
                raise SpecError(f"{where}: a state component needs {e.args[0]!r}") from None
        if args:
            raise SpecError(f"{where}: with 'components', only 'mixer' may be given, not {sorted(args)}")
        return RecurrentLayerSpec(mixer or "custom", tuple(comps))
    if mixer not in _BUILDERS:
        raise SpecError(f"{where}: mixer {mixer!r} has no builder; use one of {sorted(_BUILDERS)} or list 'components'")
    builder = _BUILDERS[mixer]
    params = inspect.signature(builder).parameters
    unknown = set(args) - set(params)
    missing = {n for n, p in params.items() if p.default is inspect.Parameter.empty} - set(args)
    if unknown or missing:
        raise SpecError(
            f"{where}: mixer {mixer!r} takes {list(params)}; missing {sorted(missing)}, unknown {sorted(unknown)}"
        )
    return builder(**args)


def spec_from_dict(data: Mapping[str, Any], source: str = "spec", state_dtype: DType | str | None = None) -> ModelSpec:
    """Build a :class:`ModelSpec` from hybridkv's format, or from a HuggingFace config dict
    (``state_dtype`` applies to HF configs; a hybridkv spec states its own dtypes)."""
    if "model_type" in data or "architectures" in data:
        return spec_from_hf_config(data, source, state_dtype)
    name = str(data.get("name", Path(source).stem))
    layers: list[LayerSpec] = []
    if "layers" in data:
        for i, t in enumerate(data["layers"]):
            kind = t.get("kind")
            where = f"{source}: layers[{i}]"
            if kind == "attention":
                layers.append(_attention(t, where))
            elif kind == "recurrent":
                layers.append(_recurrent(t, where))
            elif kind == "none":
                layers.append(NoCacheLayerSpec())
            else:
                raise SpecError(f"{where}: kind must be attention, recurrent or none, got {kind!r}")
    elif "pattern" in data:
        attn = _attention(data["attention"], f"{source}: [attention]") if "attention" in data else None
        rec = _recurrent(data["recurrent"], f"{source}: [recurrent]") if "recurrent" in data else None
        layers.extend(P.layers_from_pattern(str(data["pattern"]).replace(" ", ""), attn, rec))
    else:
        raise SpecError(f"{source}: a spec needs 'layers' or 'pattern' (see hybridkv.blockmgr.spec_io)")
    return ModelSpec(name, tuple(layers), hidden_size=data.get("hidden_size"), params_active=data.get("params_active"))


def load_spec(path: str | Path, state_dtype: DType | str | None = None) -> ModelSpec:
    """Read a model spec from a ``.json`` or ``.toml`` file (hybridkv format or HF ``config.json``)."""
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"spec file {str(p)!r} does not exist")
    try:
        if p.suffix == ".toml":
            data = tomllib.loads(p.read_text())
        else:
            data = json.loads(p.read_text())
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise SpecError(f"{p}: not valid {p.suffix.lstrip('.') or 'json'}: {e}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{p}: the top level must be a table/object")
    return spec_from_dict(data, str(p), state_dtype)


# ---- HuggingFace config.json --------------------------------------------------------------------
def _hf_attention(cfg: Mapping[str, Any], head_dim: int | None = None) -> AttentionLayerSpec:
    heads = int(cfg["num_attention_heads"])
    hd = head_dim or cfg.get("head_dim") or cfg.get("attention_head_dim") or cfg["hidden_size"] // heads
    return AttentionLayerSpec(int(cfg.get("num_key_value_heads", heads)), int(hd), DType.BFLOAT16, heads)


def spec_from_hf_config(
    cfg: Mapping[str, Any], source: str = "config.json", state_dtype: DType | str | None = None
) -> ModelSpec:
    """A spec from a HuggingFace ``config.json`` of MiniMax-M1/Text-01, Qwen3-Next, Nemotron-H, Jamba or Mamba2."""
    mt = str(cfg.get("model_type", "")).lower()
    name = str(cfg.get("_name_or_path") or mt or Path(source).stem)
    dt = DType.parse(state_dtype) if state_dtype else None
    try:
        if mt.startswith("minimax"):
            n = int(cfg["num_hidden_layers"])
            types = cfg.get("attn_type_list") or [1 if i % 8 == 7 else 0 for i in range(n)]
            pattern = "".join("A" if t == 1 else "R" for t in types[:n])
            attn = _hf_attention(cfg)
            rec = P.lightning_layer(int(cfg["num_attention_heads"]), attn.head_dim, dt or DType.FLOAT32)
        elif mt == "qwen3_next":
            n = int(cfg["num_hidden_layers"])
            if "layer_types" in cfg:
                pattern = "".join("A" if t == "full_attention" else "R" for t in cfg["layer_types"])
            else:
                k = int(cfg.get("full_attention_interval", 4))
                pattern = "".join("A" if (i + 1) % k == 0 else "R" for i in range(n))
            attn = _hf_attention(cfg)
            rec = P.gdn_layer(
                int(cfg["linear_num_key_heads"]),
                int(cfg["linear_num_value_heads"]),
                int(cfg["linear_key_head_dim"]),
                int(cfg["linear_value_head_dim"]),
                int(cfg["linear_conv_kernel_dim"]),
                dt or DType.BFLOAT16,
            )
        elif mt == "nemotron_h":
            pattern = str(cfg["hybrid_override_pattern"])
            attn = _hf_attention(cfg)
            rec = P.mamba2_layer(
                int(cfg["mamba_num_heads"]),
                int(cfg["mamba_head_dim"]),
                int(cfg["ssm_state_size"]),
                int(cfg["n_groups"]),
                int(cfg["conv_kernel"]),
                dt or DType.BFLOAT16,
            )
        elif mt == "jamba":
            n = int(cfg["num_hidden_layers"])
            period, offset = int(cfg.get("attn_layer_period", 8)), int(cfg.get("attn_layer_offset", 4))
            pattern = "".join("A" if i % period == offset else "R" for i in range(n))
            attn = _hf_attention(cfg)
            d_inner = int(cfg.get("mamba_expand", 2)) * int(cfg["hidden_size"])
            rec = P.mamba1_layer(
                d_inner, int(cfg.get("mamba_d_state", 16)), int(cfg.get("mamba_d_conv", 4)), dt or DType.BFLOAT16
            )
        elif mt == "mamba2":
            pattern = "R" * int(cfg["num_hidden_layers"])
            attn = None
            rec = P.mamba2_layer(
                int(cfg["num_heads"]),
                int(cfg["head_dim"]),
                int(cfg["state_size"]),
                int(cfg.get("n_groups", 1)),
                int(cfg.get("conv_kernel", 4)),
                dt or DType.BFLOAT16,
            )
        else:
            raise SpecError(
                f"{source}: HuggingFace model_type {mt!r} is not understood; supported: minimax*, qwen3_next, "
                "nemotron_h, jamba, mamba2 - or write a hybridkv spec file"
            )
    except KeyError as e:
        raise SpecError(f"{source}: model_type {mt!r} config lacks {e.args[0]!r}") from None
    return ModelSpec(name, P.layers_from_pattern(pattern, attn, rec), hidden_size=cfg.get("hidden_size"))


def resolve_model(name_or_path: str, state_dtype: DType | str | None = None, tp_size: int = 1) -> ModelSpec:
    """A preset by name, or a spec file by path; then sharded to ``tp_size``.

    ``state_dtype`` applies to presets and HF configs; a hybridkv spec file states its own dtypes.
    """
    p = Path(name_or_path)
    if p.suffix in (".json", ".toml") or p.is_file():
        return load_spec(p, state_dtype).shard(tp_size)
    return P.preset(name_or_path, state_dtype, tp_size)
