"""The engines ``hybridkv simulate`` can run: hybridkv's, and vLLM 0.33's behaviour on its own layout.

``engine="vllm"`` ("vLLM 0.33 (emulated)") runs the real :class:`~hybridkv.scheduler_adapter.Scheduler`
and :class:`~hybridkv.blockmgr.manager.HybridBlockManager` with vLLM 0.33.0's policies, which fix
these fields of a :class:`~hybridkv.sim.config.SimConfig` (:data:`VLLM_POLICIES`):

- layout ``padded`` at vLLM's block size (:func:`~hybridkv.planner.layout.vllm_block_size`: one
  recurrent state per attention page, the attention backend's 16-token kernel alignment);
- state in the model dtype (bf16) unless ``state_dtype`` is given (vLLM's ``mamba_ssm_cache_dtype``
  ``auto``);
- admission ``full_prompt`` (``scheduler_reserve_full_isl``, vLLM's default);
- preemption ``recompute`` (vLLM v1 has no swap), no host pool, no watermark (vLLM's default 0);
- prefix caching as ``prefix`` asks: ``none`` is vLLM's Mamba cache mode ``none``; anything else
  is its mode ``align`` (:data:`VLLM_PREFIX`): the checkpoint policy ``vllm_align`` (the state of
  every block boundary a forward ends on held in blocks of its own for two chunks, matchable only at
  the prompt's last block boundary and at the branch point, as vLLM's default
  ``prefix_cache_retention_interval=0``; chunks ending on block boundaries, stops at the branch
  point and at the prompt's last block boundary; a hit on a state cached in the same step waits a
  step; a hit is taken or the request waits, never admitted as a miss) with LRU eviction, at vLLM's block size with
  prefix caching (Qwen3-Next's GDN layers: a multiple of FlashInfer's 64-token checkpoint grid,
  :data:`VLLM_CHECKPOINT_ALIGNMENT`).

The victim order is the same as vLLM's (the newest running request; with one priority, admission
order and arrival order agree). ``tests/test_vllm_scheduler.py`` replays trace requests through
vLLM's real v1 ``Scheduler`` and ``KVCacheManager`` and through this engine and checks that they
schedule the same rows and preempt the same requests at every step with prefix caching off, and
that prefix-hit tokens and preemptions agree within 2% with it on.

:func:`ladder` turns ``--compare engine=hybridkv,vllm`` into one column per switch, from vLLM's
policies to hybridkv's, so that every difference in the table has one cause.
"""

from __future__ import annotations

from typing import Any

from hybridkv.sim.settings import ENGINES, VLLM_LABEL, SimConfig

__all__ = ["ENGINES", "VLLM_LABEL", "VLLM_POLICIES", "engine_config", "ladder"]
VLLM_POLICIES: dict[str, Any] = {
    "layout": "padded",
    "admission": "full_prompt",
    "preemption": "recompute",
    "host_memory": "0",
    "host_cache": "0",  # (vLLM 0.33 keeps no host tier of its own: connectors do)
    "watermark": 0.0,
    "speculative": 0,
}
VLLM_STATE_DTYPE = "bfloat16"
VLLM_PREFIX: dict[str, Any] = {"prefix": "lru", "checkpoint": "vllm_align"}  # Mamba cache mode "align"
# recurrent mixers whose vLLM prefill kernel exports checkpoints, and its grid in tokens (FlashInfer's
# GDN prefill on Hopper); the others (MiniMax's lightning attention) export none
VLLM_CHECKPOINT_ALIGNMENT = {"gdn": 64}
# the same for hybridkv's own kernels: hybridkv.ops.lightning_prefill(exports=) writes the state after
# any token of a row (both backends); its GDN kernel (integrations/fastdeploy/kernels.py,
# gated_delta_kernel) writes only the state after a row's last token
HYBRIDKV_CHECKPOINT_ALIGNMENT = {"lightning": 1}


def engine_config(cfg: SimConfig) -> SimConfig:
    """``cfg`` with its engine's policies applied: the vLLM engine's fields fixed (its block size
    from the model); a hybridkv config is returned as it is, but for ``checkpoint_export`` -1, which
    becomes its kernels' grid (:data:`HYBRIDKV_CHECKPOINT_ALIGNMENT`: every recurrent mixer must
    export, else 0). Raises what resolving the model raises."""
    if cfg.engine == "hybridkv":
        if cfg.checkpoint_export >= 0:
            return cfg
        if cfg.prefix == "none":
            return cfg.with_changes(checkpoint_export=0, label=cfg.label)
        grids = [HYBRIDKV_CHECKPOINT_ALIGNMENT.get(m, 0) for m in _mixers(cfg.model, cfg.state_dtype, cfg.tp)[1]]
        return cfg.with_changes(checkpoint_export=min(grids) if grids and all(grids) else 0, label=cfg.label)
    from hybridkv.planner.layout import vllm_block_size

    dtype = cfg.state_dtype or VLLM_STATE_DTYPE
    model, mixers = _mixers(cfg.model, dtype, cfg.tp)
    caching = cfg.prefix != "none"
    grid = max((VLLM_CHECKPOINT_ALIGNMENT.get(m, 0) for m in mixers), default=0) or None
    block = vllm_block_size(model, prefix_caching=caching, checkpoint_alignment=grid)
    prefix = VLLM_PREFIX | {"checkpoint_export": grid or 0} if caching else {"prefix": "none", "checkpoint_export": 0}
    return cfg.with_changes(**VLLM_POLICIES, **prefix, state_dtype=dtype, block_size=block, label=cfg.label)


def _mixers(name: str, dtype: str | None, tp: int) -> tuple[Any, set[str]]:
    """The model ``name`` resolves to and its recurrent mixers (``lightning``, ``gdn``, ...)."""
    from hybridkv.models.spec import RecurrentLayerSpec
    from hybridkv.models.spec_file import resolve_model

    model = resolve_model(name, dtype, tp)
    return model, {layer.mixer for layer in model.layers if isinstance(layer, RecurrentLayerSpec)}


_SWITCHES: tuple[tuple[str, ...], ...] = (  # the fields of one column's switch, in ladder order
    ("admission",),
    ("layout", "block_size"),
    ("state_dtype",),
    ("preemption", "host_memory", "watermark"),
    ("host_cache",),
    ("prefix", "checkpoint", "checkpoint_export", "speculative"),
)


def ladder(hybridkv: SimConfig) -> list[SimConfig]:
    """``--compare engine=hybridkv,vllm``: vLLM 0.33 (emulated), then hybridkv's engine with one
    policy switched from vLLM's to ``hybridkv``'s per column (admission, layout and block size,
    state dtype, preemption with its host pool and watermark, prefix caching), skipping the ones
    that are already equal. The last column has every field of ``hybridkv``."""
    vllm = engine_config(hybridkv.with_changes(engine="vllm"))
    vllm = vllm.with_changes(label=VLLM_LABEL)
    out = [vllm]
    cur = vllm.with_changes(engine="hybridkv", label=vllm.label)
    for keys in _SWITCHES:
        diff = {k: getattr(hybridkv, k) for k in keys if getattr(cur, k) != getattr(hybridkv, k)}
        if diff.keys() == {"state_dtype"} and _default_state_dtype(hybridkv) == cur.state_dtype:
            continue  # the model's own default is vLLM's dtype: a column that would change nothing
        if not diff:
            continue
        hidden = {"block_size", "checkpoint_export"} | ({"checkpoint"} if "prefix" in diff else set())
        what = " ".join(_show(k, v, hybridkv) for k, v in diff.items() if k not in hidden or v and k == "block_size")
        cur = cur.with_changes(**diff, label=f"+ {what}")
        out.append(cur)
    if len(out) > 1:
        out[-1] = out[-1].with_changes(label=f"{out[-1].label} (= hybridkv)")
    return out


def _default_state_dtype(cfg: SimConfig) -> str | None:
    """The state dtype ``cfg`` runs with: its own, else its preset's default (None for a spec file)."""
    if cfg.state_dtype is not None:
        return cfg.state_dtype
    from hybridkv.models.presets import default_state_dtype

    try:
        return default_state_dtype(cfg.model).value
    except Exception:  # noqa: BLE001 - a spec file or HF config: its own dtypes
        return None


def _show(key: str, value: Any, cfg: SimConfig) -> str:
    """One switch of a :func:`ladder` column label, e.g. ``layout paged`` or ``state float32``."""
    if key == "state_dtype" and value is None:
        from hybridkv.models.presets import default_state_dtype

        try:
            value = default_state_dtype(cfg.model).value
        except Exception:  # noqa: BLE001 - a spec file or HF config: its own dtypes
            value = "as the spec says"
        return f"state {value}"
    if key == "host_memory":
        return f"host {value}"
    if key == "block_size":
        return f"/{value}"
    if key in ("prefix", "checkpoint"):
        return f"prefix {cfg.prefix}/{cfg.checkpoint}" if cfg.prefix != "none" else "prefix none"
    return f"{key.replace('_', '-')} {value}"
