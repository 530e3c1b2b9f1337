"""Model specs from files: hybridkv's own JSON/TOML format (HuggingFace ``config.json`` files go to
:mod:`hybridkv.models.hf`).

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
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hybridkv.errors import SpecError
from hybridkv.models import presets as P
from hybridkv.models.fields import MAX_LAYERS, _dtype, _field, _kind, _list, _optional_number, _table, _text, _whole
from hybridkv.models.hf import spec_from_hf_config
from hybridkv.models.spec import (
    AttentionLayerSpec,
    DType,
    LayerSpec,
    ModelSpec,
    NoCacheLayerSpec,
    RecurrentLayerSpec,
    StateComponent,
)
from hybridkv.units import is_integer

_BUILDERS: dict[str, Callable[..., RecurrentLayerSpec]] = {
    "lightning": P.lightning_layer,
    "mamba": P.mamba1_layer,
    "mamba2": P.mamba2_layer,
    "gdn": P.gdn_layer,
    "rwkv": P.rwkv_layer,
    "gla": P.gla_layer,
    "retention": P.retention_layer,
    "kda": P.kda_layer,
    "short_conv": P.short_conv_layer,
    "rwkv4": P.rwkv4_layer,
    "mlstm": P.mlstm_layer,
}


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


def spec_from_dict(
    data: Mapping[str, Any],
    source: str = "spec",
    state_dtype: DType | str | None = None,
    conv_dtype: DType | str | None = None,
) -> ModelSpec:
    """Build a :class:`ModelSpec` from hybridkv's format, or from a HuggingFace config dict
    (``state_dtype`` / ``conv_dtype`` apply to HF configs; a hybridkv spec states its own dtypes).

    Raises :class:`SpecError` (one line naming the field) for any malformed input.
    """
    data = _table(data, source)
    if "model_type" in data or "architectures" in data:
        return spec_from_hf_config(data, source, state_dtype, conv_dtype)
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
        raise SpecError(f"{source}: a spec needs 'layers' or 'pattern' (see hybridkv.models.spec_file)")
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


def load_spec(
    path: str | Path,
    state_dtype: DType | str | None = None,
    conv_dtype: DType | str | None = None,
    tp_size: int = 1,
) -> ModelSpec:
    """Read a model spec from a ``.json`` or ``.toml`` file (hybridkv format or HF ``config.json``),
    or from a model directory holding ``config.json``; sharded to ``tp_size`` ranks (one rank's
    layers, as :func:`~hybridkv.models.presets.preset` gives them; 1: the whole model)."""
    if not is_integer(tp_size) or tp_size < 1:
        raise ValueError(f"tp_size must be an integer >= 1, got {tp_size!r}")
    p = Path(path)
    source = str(p / "config.json") if p.is_dir() else str(p)
    spec = spec_from_dict(read_spec_file(p), source, state_dtype, conv_dtype)
    return spec.shard(tp_size)


def resolve_model(
    name_or_path: str,
    state_dtype: DType | str | None = None,
    tp_size: int = 1,
    conv_dtype: DType | str | None = None,
) -> ModelSpec:
    """A preset by name, or a spec file / model directory by path; then sharded to ``tp_size``.

    ``state_dtype`` / ``conv_dtype`` apply to presets and HF configs; a hybridkv spec file states its
    own dtypes.
    """
    if is_spec_path(name_or_path):
        return load_spec(name_or_path, state_dtype, conv_dtype, tp_size)
    return P.preset(name_or_path, state_dtype, tp_size, conv_dtype)


def is_spec_path(name_or_path: str) -> bool:
    """True when ``name_or_path`` names a spec file or a model directory rather than a preset."""
    p = Path(name_or_path)
    if p.suffix in (".json", ".toml") or p.is_file():
        return True
    return p.is_dir() and ((p / "config.json").is_file() or name_or_path.strip().lower() not in P.PRESET_NAMES)
