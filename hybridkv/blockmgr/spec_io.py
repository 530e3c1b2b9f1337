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

Every value is checked for its type before use: a malformed file raises :class:`SpecError` naming
the file and the field, never a ``TypeError`` from deep inside; counts must be whole numbers
(``8.0`` is read as 8, ``8.7`` is refused, not truncated).
"""

from __future__ import annotations

import inspect
import json
import math
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
_MISSING = object()
MAX_LAYERS = 100_000  # far above any real model; a bigger count is a typo, not a model to expand


# ---- typed field readers: one error message shape for every bad value ---------------------------
def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {value}".lower()
    if isinstance(value, Mapping):
        return "a table"
    if isinstance(value, list | tuple):
        return "a list"
    return f"{type(value).__name__} {value!r}"[:80]


def _whole(value: Any, where: str, field: str, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum``: ints and integral floats; bools, strings, fractions refused."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SpecError(f"{where}: {field} must be a whole number, got {_kind(value)}")
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise SpecError(f"{where}: {field} must be a whole number, got {value!r} (not truncated)")
        value = int(value)
    if value < minimum:
        raise SpecError(f"{where}: {field} must be >= {minimum}, got {value}")
    return value


def _field(table: Mapping[str, Any], key: str, where: str, default: Any = _MISSING, minimum: int = 1) -> int:
    value = table.get(key, default)
    if value is None and default is not _MISSING:
        value = default  # HF configs write null for "use the default"
    if value is _MISSING:
        raise SpecError(f"{where}: needs {key!r}")
    return _whole(value, where, key, minimum)


def _table(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise SpecError(f"{where}: must be a table/object, got {_kind(value)}")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise SpecError(f"{where}: must be a list, got {_kind(value)}")
    return list(value)


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise SpecError(f"{where}: must be a string, got {_kind(value)}")
    return value


def _dtype(value: Any, where: str) -> DType:
    if not isinstance(value, str | DType):
        raise SpecError(f"{where}: dtype must be a string such as 'bfloat16', got {_kind(value)}")
    try:
        return DType.parse(value)
    except SpecError as e:
        raise SpecError(f"{where}: {e}") from None


def _optional_number(data: Mapping[str, Any], key: str, where: str) -> float | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise SpecError(f"{where}: {key} must be a positive number, got {_kind(value)}")
    return value


# ---- hybridkv format ----------------------------------------------------------------------------
def _attention(table: Any, where: str) -> AttentionLayerSpec:
    table = _table(table, where)
    allowed = {"num_kv_heads", "head_dim", "dtype", "num_q_heads", "kind"}
    extra = set(table) - allowed
    if extra:
        raise SpecError(f"{where}: unknown attention keys {sorted(extra)}; allowed: {sorted(allowed - {'kind'})}")
    q_heads = table.get("num_q_heads")
    return AttentionLayerSpec(
        _field(table, "num_kv_heads", where),
        _field(table, "head_dim", where),
        _dtype(table.get("dtype", "bfloat16"), where),
        None if q_heads is None else _whole(q_heads, where, "num_q_heads"),
    )


def _component(c: Any, where: str) -> StateComponent:
    c = _table(c, where)
    allowed = {"name", "shape", "dtype", "tp_axis"}
    if set(c) - allowed:
        raise SpecError(f"{where}: unknown keys {sorted(set(c) - allowed)}; allowed: {sorted(allowed)}")
    if "name" not in c or "shape" not in c:
        raise SpecError(f"{where}: a state component needs 'name' and 'shape'")
    name = _text(c["name"], f"{where}.name")
    shape = tuple(_whole(s, where, f"shape[{j}]") for j, s in enumerate(_list(c["shape"], f"{where}.shape")))
    if not shape:
        raise SpecError(f"{where}: shape must not be empty")
    axis = c.get("tp_axis", 0)
    if axis is not None:
        axis = _whole(axis, where, "tp_axis", minimum=0)
        if axis >= len(shape):
            raise SpecError(f"{where}: tp_axis={axis} is outside shape {list(shape)} (or null: not divided)")
    return StateComponent(name, shape, _dtype(c.get("dtype", "bfloat16"), where), axis)


def _recurrent(table: Any, where: str) -> RecurrentLayerSpec:
    table = _table(table, where)
    args = {k: v for k, v in table.items() if k not in ("kind", "mixer", "components")}
    mixer = table.get("mixer")
    if mixer is not None and not isinstance(mixer, str):
        raise SpecError(f"{where}: mixer must be a string, got {_kind(mixer)}")
    if "components" in table:
        comps = _list(table["components"], f"{where}.components")
        if not comps:
            raise SpecError(f"{where}: components must list at least one state tensor")
        if args:
            raise SpecError(f"{where}: with 'components', only 'mixer' may be given, not {sorted(args)}")
        return RecurrentLayerSpec(
            mixer or "custom", tuple(_component(c, f"{where}.components[{j}]") for j, c in enumerate(comps))
        )
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
    typed = {k: _dtype(v, where) if k.endswith("dtype") else _whole(v, where, k) for k, v in args.items()}
    return builder(**typed)


def _name(data: Mapping[str, Any], source: str) -> str:
    name = data.get("name", Path(source).stem)
    if not isinstance(name, str) or not name.strip():
        raise SpecError(f"{source}: name must be a non-empty string, got {_kind(name)}")
    return name


def spec_from_dict(data: Mapping[str, Any], source: str = "spec", state_dtype: DType | str | None = None) -> ModelSpec:
    """Build a :class:`ModelSpec` from hybridkv's format, or from a HuggingFace config dict
    (``state_dtype`` applies to HF configs; a hybridkv spec states its own dtypes).

    Raises :class:`SpecError` (one line naming the field) for any malformed input.
    """
    data = _table(data, source)
    if "model_type" in data or "architectures" in data:
        return spec_from_hf_config(data, source, state_dtype)
    name = _name(data, source)
    layers: list[LayerSpec] = []
    if "layers" in data:
        for i, t in enumerate(_list(data["layers"], f"{source}: layers")):
            where = f"{source}: layers[{i}]"
            kind = _table(t, where).get("kind")
            if kind == "attention":
                layers.append(_attention(t, where))
            elif kind == "recurrent":
                layers.append(_recurrent(t, where))
            elif kind == "none":
                if set(t) - {"kind"}:
                    raise SpecError(f"{where}: a 'none' layer takes no other keys, got {sorted(set(t) - {'kind'})}")
                layers.append(NoCacheLayerSpec())
            else:
                raise SpecError(f"{where}: kind must be attention, recurrent or none, got {_kind(kind)}")
    elif "pattern" in data:
        pattern = _text(data["pattern"], f"{source}: pattern")
        attn = _attention(data["attention"], f"{source}: [attention]") if "attention" in data else None
        rec = _recurrent(data["recurrent"], f"{source}: [recurrent]") if "recurrent" in data else None
        try:
            layers.extend(P.layers_from_pattern("".join(pattern.split()), attn, rec))
        except SpecError as e:
            raise SpecError(f"{source}: {e}") from None
    else:
        raise SpecError(f"{source}: a spec needs 'layers' or 'pattern' (see hybridkv.blockmgr.spec_io)")
    if not layers:
        raise SpecError(f"{source}: the model has no layers")
    if len(layers) > MAX_LAYERS:
        raise SpecError(f"{source}: {len(layers):,} layers is above {MAX_LAYERS:,}: not a model this planner expands")
    hidden = data.get("hidden_size")
    try:
        return ModelSpec(
            name,
            tuple(layers),
            hidden_size=None if hidden is None else _whole(hidden, source, "hidden_size"),
            params_active=_optional_number(data, "params_active", source),
        )
    except SpecError as e:
        raise SpecError(f"{source}: {e}") from None


def read_spec_file(path: str | Path) -> dict[str, Any]:
    """The table a ``.json`` / ``.toml`` spec file (or a model directory's ``config.json``) holds.

    Raises :class:`SpecError` for a missing or unreadable file, bad encoding or bad syntax.
    """
    p = Path(path)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise SpecError(f"model directory {str(p)!r} has no config.json")
        p = p / "config.json"
    if not p.is_file():
        raise SpecError(f"spec file {str(p)!r} does not exist")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"{p}: not UTF-8 text (byte {e.start}): a spec file is JSON or TOML") from None
    except OSError as e:
        raise SpecError(f"{p}: cannot read: {e.strerror or e}") from None
    fmt = "toml" if p.suffix == ".toml" else "json"
    try:
        data = tomllib.loads(text) if fmt == "toml" else json.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise SpecError(f"{p}: not valid {fmt}: {e}") from None
    except RecursionError:
        raise SpecError(f"{p}: not valid {fmt}: nested too deeply") from None
    except ValueError as e:  # e.g. an integer literal too long to convert
        raise SpecError(f"{p}: not valid {fmt}: {e}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{p}: the top level must be a table/object, got {_kind(data)}")
    return data


def load_spec(path: str | Path, state_dtype: DType | str | None = None) -> ModelSpec:
    """Read a model spec from a ``.json`` or ``.toml`` file (hybridkv format or HF ``config.json``),
    or from a model directory holding ``config.json``."""
    p = Path(path)
    source = str(p / "config.json") if p.is_dir() else str(p)
    return spec_from_dict(read_spec_file(p), source, state_dtype)


# ---- HuggingFace config.json --------------------------------------------------------------------
def _hf_attention(cfg: Mapping[str, Any], where: str) -> AttentionLayerSpec:
    heads = _field(cfg, "num_attention_heads", where)
    hd = cfg.get("head_dim") or cfg.get("attention_head_dim")
    if hd is None:
        hidden = _field(cfg, "hidden_size", where)
        if hidden % heads:
            raise SpecError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        hd = hidden // heads
    kv = _field(cfg, "num_key_value_heads", where, default=heads)
    return AttentionLayerSpec(kv, _whole(hd, where, "head_dim"), DType.BFLOAT16, heads)


def _num_layers(cfg: Mapping[str, Any], where: str) -> int:
    n = _field(cfg, "num_hidden_layers", where)
    if n > MAX_LAYERS:
        raise SpecError(f"{where}: num_hidden_layers {n:,} is above {MAX_LAYERS:,}: not a model this planner expands")
    return n


def _hf_types(cfg: Mapping[str, Any], key: str, n: int, where: str) -> list[Any]:
    types = _list(cfg[key], f"{where}: {key}")
    if len(types) != n:
        raise SpecError(f"{where}: {key} has {len(types)} entries, num_hidden_layers is {n}")
    return types


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
        if mt.startswith("minimax"):
            n = _num_layers(cfg, where)
            if "attn_type_list" in cfg:
                types = _hf_types(cfg, "attn_type_list", n, where)
                if any(t not in (0, 1) or isinstance(t, bool) for t in types):
                    raise SpecError(f"{where}: attn_type_list entries must be 0 (lightning) or 1 (softmax)")
            else:
                types = [1 if i % 8 == 7 else 0 for i in range(n)]
            pattern = "".join("A" if t == 1 else "R" for t in types)
            attn = _hf_attention(cfg, where)
            rec = P.lightning_layer(attn.num_q_heads or attn.num_kv_heads, attn.head_dim, dt or DType.FLOAT32)
        elif mt == "qwen3_next":
            n = _num_layers(cfg, where)
            if "layer_types" in cfg:
                types = _hf_types(cfg, "layer_types", n, where)
                allowed = ("full_attention", "linear_attention")
                if any(t not in allowed for t in types):
                    raise SpecError(f"{where}: layer_types entries must be one of {list(allowed)}")
                pattern = "".join("A" if t == "full_attention" else "R" for t in types)
            else:
                k = _field(cfg, "full_attention_interval", where, default=4)
                pattern = "".join("A" if (i + 1) % k == 0 else "R" for i in range(n))
            attn = _hf_attention(cfg, where)
            rec = P.gdn_layer(
                _field(cfg, "linear_num_key_heads", where),
                _field(cfg, "linear_num_value_heads", where),
                _field(cfg, "linear_key_head_dim", where),
                _field(cfg, "linear_value_head_dim", where),
                _field(cfg, "linear_conv_kernel_dim", where, minimum=2),
                dt or DType.BFLOAT16,
            )
        elif mt == "nemotron_h":
            pattern = _text(cfg.get("hybrid_override_pattern"), f"{where}: hybrid_override_pattern")
            attn = _hf_attention(cfg, where)
            rec = P.mamba2_layer(
                _field(cfg, "mamba_num_heads", where),
                _field(cfg, "mamba_head_dim", where),
                _field(cfg, "ssm_state_size", where),
                _field(cfg, "n_groups", where),
                _field(cfg, "conv_kernel", where, minimum=2),
                dt or DType.BFLOAT16,
            )
        elif mt == "jamba":
            n = _num_layers(cfg, where)
            period = _field(cfg, "attn_layer_period", where, default=8)
            offset = _field(cfg, "attn_layer_offset", where, default=4, minimum=0)
            if offset >= period:
                raise SpecError(f"{where}: attn_layer_offset {offset} must be below attn_layer_period {period}")
            pattern = "".join("A" if i % period == offset else "R" for i in range(n))
            attn = _hf_attention(cfg, where)
            d_inner = _field(cfg, "mamba_expand", where, default=2) * _field(cfg, "hidden_size", where)
            rec = P.mamba1_layer(
                d_inner,
                _field(cfg, "mamba_d_state", where, default=16),
                _field(cfg, "mamba_d_conv", where, default=4, minimum=2),
                dt or DType.BFLOAT16,
            )
        elif mt == "mamba2":
            pattern = "R" * _num_layers(cfg, where)
            attn = None
            rec = P.mamba2_layer(
                _field(cfg, "num_heads", where),
                _field(cfg, "head_dim", where),
                _field(cfg, "state_size", where),
                _field(cfg, "n_groups", where, default=1),
                _field(cfg, "conv_kernel", where, default=4, minimum=2),
                dt or DType.BFLOAT16,
            )
        else:
            raise SpecError(
                f"{source}: HuggingFace model_type {mt!r} is not understood; supported: minimax*, qwen3_next, "
                "nemotron_h, jamba, mamba2 - or write a hybridkv spec file"
            )
        hidden = cfg.get("hidden_size")
        return ModelSpec(
            name,
            P.layers_from_pattern(pattern, attn, rec),
            hidden_size=None if hidden is None else _whole(hidden, where, "hidden_size"),
        )
    except SpecError as e:
        msg = str(e)
        raise SpecError(msg if msg.startswith(source) else f"{where}: {msg}") from None


def resolve_model(name_or_path: str, state_dtype: DType | str | None = None, tp_size: int = 1) -> ModelSpec:
    """A preset by name, or a spec file / model directory by path; then sharded to ``tp_size``.

    ``state_dtype`` applies to presets and HF configs; a hybridkv spec file states its own dtypes.
    """
    if is_spec_path(name_or_path):
        return load_spec(name_or_path, state_dtype).shard(tp_size)
    return P.preset(name_or_path, state_dtype, tp_size)


def is_spec_path(name_or_path: str) -> bool:
    """True when ``name_or_path`` names a spec file or a model directory rather than a preset."""
    p = Path(name_or_path)
    if p.suffix in (".json", ".toml") or p.is_file():
        return True
    return p.is_dir() and ((p / "config.json").is_file() or name_or_path.strip().lower() not in P.PRESET_NAMES)
