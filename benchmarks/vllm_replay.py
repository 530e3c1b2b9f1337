"""One workload through vLLM 0.33's real v1 ``Scheduler`` + ``KVCacheManager`` and through hybridkv's
``Scheduler``, step by step: the harness of ``benchmarks/bench_vs_vllm_scheduler.py`` and
``tests/test_vllm_scheduler.py`` (issue 29).

The workload (the issue's): the first ``limit`` requests of the Mooncake synthetic trace, all queued
at step 0 in trace order; every row that reaches the end of its known tokens samples one fake token;
outputs of ``output_length`` tokens (no stop tokens). A step is recorded as its scheduled rows
``{request id: (first position, tokens)}`` and the requests it preempted.

vLLM's side is built as its engine core builds it, from per-layer KV cache specs of the model (one
``FullAttentionSpec`` per attention layer, one ``MambaSpec`` per recurrent layer with the model's
state shapes and dtypes, its page padded to the attention page): vLLM's own
``get_kv_cache_groups`` and ``get_kv_cache_config_from_groups`` group the layers and size the pool
from the memory budget, ``resolve_kv_cache_block_sizes`` gives the scheduler's block size, and its
``VllmConfig`` reads a 2-layer llama ``config.json`` written to a temporary directory (no weights,
no tokenizer). Prefix caching off: vLLM's Mamba cache mode ``none`` (one state block per request and
group; with ``prefix_caching``, mode ``align``). The attention block size comes from vLLM's own
``_align_hybrid_block_size``, run with an H200's inputs stood in (:func:`vllm_aligned_block_size`);
``tests/test_vllm_scheduler.py`` checks it against hybridkv's ``vllm_block_size``, and vLLM's pool
sizing against the engine's layout.

vLLM is imported lazily (``VLLM_TARGET_DEVICE=cpu`` is set here when unset); the module imports
without it.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.prefix import PrefixCacheConfig
from hybridkv.models.presets import preset
from hybridkv.models.spec import AttentionLayerSpec, ModelSpec, RecurrentLayerSpec
from hybridkv.planner.layout import Layout, LayoutKind, plan
from hybridkv.scheduler_adapter import Scheduler, SchedulerConfig, StepOutputs
from hybridkv.scheduler_adapter.cost import PreemptionMode
from hybridkv.scheduler_adapter.scheduler import AdmissionPolicy
from hybridkv.sim.trace import DEFAULT_TRACE, load_trace

GiB = 1024**3
MAX_MODEL_LEN = 1 << 18  # above the trace's longest request (135,155 tokens in the first 400)
# the runs: (preset, TP); state in bf16, the model dtype vLLM keeps it in
MODELS = {"minimax-m1": ("minimax-m1", 8), "qwen3-next": ("qwen3-next-80b-a3b", 2)}


class Req(NamedTuple):
    request_id: str
    num_prompt_tokens: int
    max_new_tokens: int
    token_ids: tuple[int, ...] | None = None  # the prompt's ids (prefix caching), as the simulator makes them


class Step(NamedTuple):
    """One scheduler step: ``rows[request id] = (num_computed_tokens, num_scheduled_tokens)``."""

    rows: dict[str, tuple[int, int]]
    preempted: tuple[str, ...]

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.rows.values())


@dataclass(frozen=True)
class Run:
    """Totals of a replay (the issue's table: steps / preemptions / scheduled tokens)."""

    steps: list[Step]
    prefix_hit_tokens: int = 0  # summed over admissions (a recomputed request is admitted again)

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def num_preemptions(self) -> int:
        return sum(len(s.preempted) for s in self.steps)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.steps)

    def totals(self) -> dict[str, int]:
        return {
            "steps": self.num_steps,
            "preemptions": self.num_preemptions,
            "scheduled_tokens": self.num_scheduled_tokens,
        }


def trace_requests(limit: int, path: str | Path = DEFAULT_TRACE, token_ids: bool = False) -> list[Req]:
    """The first ``limit`` trace requests (``FileNotFoundError`` without the trace); ``token_ids``:
    with their prompts' token ids as ``hybridkv simulate`` makes them (``Workload.token_ids``)."""
    from hybridkv.sim.workload import Workload

    w = Workload.__new__(Workload)  # (token_ids is a static method: no Workload needed)
    out = []
    for t in load_trace(path, limit):
        ids = None
        if token_ids:
            from hybridkv.sim.workload import SimRequest

            ids = tuple(w.token_ids(SimRequest("", 0.0, t.input_length, t.output_length, t.hash_ids)))
        out.append(Req(f"t{t.index}", t.input_length, t.output_length, ids))
    return out


def model_spec(model: str) -> ModelSpec:
    name, tp = MODELS[model]
    return preset(name, "bfloat16", tp)


def padded_layout(model: str, budget_bytes: int) -> Layout:
    """vLLM's layout with prefix caching off: padded, bf16 state (see the module docstring)."""
    return plan(model_spec(model), budget_bytes, layout=LayoutKind.PADDED)


def engine_scheduler(
    model: str, budget_bytes: int, admission: str | None = None, prefix_caching: bool = False, **changes: Any
) -> Scheduler:
    """The scheduler of ``hybridkv simulate --engine vllm`` (``hybridkv.sim.engines``: vLLM 0.33's
    policies on its layout) for ``model``; ``admission``: another admission rule on that engine's
    layout and policies (``first_chunk`` is vLLM with ``scheduler_reserve_full_isl`` off);
    ``prefix_caching``: vLLM's Mamba cache mode ``align`` (else ``none``)."""
    from hybridkv.sim.config import SimConfig, build
    from hybridkv.sim.engines import engine_config

    name, tp = MODELS[model]
    changes.setdefault("prefix", "lru" if prefix_caching else "none")
    cfg = engine_config(SimConfig(model=name, tp=tp, gpu_memory=str(budget_bytes), engine="vllm", **changes))
    if admission is not None:
        cfg = cfg.with_changes(engine="hybridkv", admission=admission)
    return build(cfg).scheduler


# ---- hybridkv ------------------------------------------------------------------------------------
def hybridkv_scheduler(
    layout: Layout,
    admission: AdmissionPolicy | str = AdmissionPolicy.RESERVED,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    prefix: PrefixCacheConfig | None = None,
) -> Scheduler:
    """hybridkv's scheduler on ``layout``: recompute, no watermark, no host pool; no prefix cache
    unless ``prefix`` is given."""
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        preemption_mode=PreemptionMode.RECOMPUTE,
        admission=admission,
    )
    return Scheduler(HybridBlockManager(layout, prefix_cache=prefix), config)


def replay_hybridkv(sched: Scheduler, requests: Iterable[Req], max_steps: int = 1_000_000) -> Run:
    """The same loop through hybridkv's scheduler (prompts as token ids when the requests have them)."""
    for r in requests:
        sched.add_request(r.request_id, r.num_prompt_tokens if r.token_ids is None else r.token_ids, r.max_new_tokens)
    steps = []
    hits = 0
    while sched.has_unfinished and len(steps) < max_steps:
        p = sched.step()
        hits += sum(sched.requests[rid].num_cached_tokens for rid in p.admitted)
        steps.append(
            Step(
                {x.request_id: (x.num_computed_tokens, x.num_scheduled_tokens) for x in p.scheduled},
                tuple(x.request_id for x in p.preempted),
            )
        )
        sched.update(StepOutputs({x.request_id: [7] for x in p.scheduled if x.samples}))
    return Run(steps, hits)


# ---- vLLM ----------------------------------------------------------------------------------------
def _cpu() -> None:
    """vLLM builds its configs without a GPU only with this set before its first import."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is a local directory


def vllm_config(
    model_dir: str,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    block_size: int,
    reserve_full_isl: bool,
    kv_heads: int = 1,
    head_dim: int = 32,
    max_model_len: int = MAX_MODEL_LEN,
) -> Any:
    """vLLM's ``VllmConfig`` over a 2-layer llama ``config.json`` written to ``model_dir`` (no weights,
    no tokenizer), prefix caching off in the config (the KV cache config given to the scheduler decides)."""
    _cpu()
    from vllm.config import CacheConfig, ModelConfig, VllmConfig
    from vllm.config import SchedulerConfig as VSchedulerConfig

    hf_config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": 2,
        "vocab_size": 1000,
        "max_position_embeddings": max_model_len,
        "torch_dtype": "bfloat16",
    }
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(hf_config, f)
    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, max_model_len=max_model_len, dtype="bfloat16")
    sched = VSchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        is_encoder_decoder=False,
        scheduler_reserve_full_isl=reserve_full_isl,
    )
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=False)
    config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache)
    config.cache_config.kv_cache_layout = "LBNHC"  # FlashAttention's NHD (the engine core resolves it)
    return config


def vllm_layer_specs(
    spec: ModelSpec, block_size: int, align: bool = False, checkpoints: bool = False
) -> dict[str, Any]:
    """Per-layer vLLM KV cache specs of ``spec`` (one TP rank). ``align``: prefix caching on
    (Mamba cache mode ``align``, state blocks of ``block_size`` tokens); ``checkpoints``: the
    recurrent layers export prefill checkpoints (FlashInfer's GDN prefill on Hopper: one
    checkpoint block per request, on the block grid), so the prompt's last block is not split off."""
    _cpu()
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    spec = spec.cache_view()
    out: dict[str, Any] = {}
    page = None
    for i, layer in enumerate(spec.layers):
        if isinstance(layer, AttentionLayerSpec):
            a = FullAttentionSpec(
                block_size=block_size,
                num_kv_heads=layer.num_kv_heads,
                head_size=layer.head_dim,
                dtype=dtypes[layer.dtype.value],
            )
            out[f"model.layers.{i}.self_attn.attn"] = a
            page = a.page_size_bytes
    for i, layer in enumerate(spec.layers):
        if isinstance(layer, RecurrentLayerSpec):
            extra = {}
            if checkpoints:
                extra = {"num_prefill_checkpoint_blocks": 1, "prefill_checkpoint_alignment": block_size}
            out[f"model.layers.{i}.linear_attn"] = MambaSpec(
                # mode "none": one block holds a whole sequence's state
                block_size=block_size if align else MAX_MODEL_LEN,
                shapes=tuple(c.shape for c in layer.components),
                dtypes=tuple(dtypes[c.dtype.value] for c in layer.components),
                page_size_padded=page,
                mamba_cache_mode="align" if align else "none",
                **extra,
            )
    return out


def vllm_aligned_block_size(model: str, prefix_caching: bool = False) -> int:
    """The attention block size vLLM's own start-up code (``Platform._align_hybrid_block_size``)
    gives ``model`` on an H200, run here with the H200's inputs stood in (no GPU, no model code):
    FlashAttention as the attention backend (kernel blocks: multiples of 16 tokens), the model's
    state shapes and dtypes as its model class would report them, and, with prefix caching, the
    recurrent layers' prefill checkpoint alignment (FlashInfer's GDN prefill on Hopper: 64 tokens;
    MiniMax-M1's lightning layers: none). The arithmetic is vLLM's."""
    _cpu()
    import torch
    import vllm.model_executor.layers.mamba.abstract as mamba_abstract
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms import current_platform
    from vllm.v1.attention.backend import MultipleOf

    spec = model_spec(model).cache_view()
    attn = next(layer for layer in spec.layers if isinstance(layer, AttentionLayerSpec))
    recurrent = [layer for layer in spec.layers if isinstance(layer, RecurrentLayerSpec)]
    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    gdn = any(layer.mixer == "gdn" for layer in recurrent)

    class FlashAttentionLike:  # what _align_hybrid_block_size asks of the backend
        @staticmethod
        def get_supported_kernel_block_sizes() -> list:
            return [MultipleOf(16)]

        @staticmethod
        def customize_spec(s: Any) -> Any:
            return s

        @staticmethod
        def get_name() -> str:
            return "FLASH_ATTN"

    class ModelClass:  # the state a Qwen3-Next / MiniMax model class reports, from hybridkv's spec
        @staticmethod
        def get_mamba_state_shape_from_config(vllm_config: Any) -> tuple:
            return tuple(c.shape for c in recurrent[0].components)

        @staticmethod
        def get_mamba_state_dtype_from_config(vllm_config: Any) -> tuple:
            return tuple(dtypes[c.dtype.value] for c in recurrent[0].components)

    with tempfile.TemporaryDirectory(prefix="vllm_replay_") as model_dir:
        config = vllm_config(model_dir, 256, 8192, 16, True, kv_heads=attn.num_kv_heads, head_dim=attn.head_dim)
    if prefix_caching:
        config.cache_config.enable_prefix_caching, config.cache_config.mamba_cache_mode = True, "align"
    platform = type(current_platform)
    saved = (ModelRegistry.resolve_model_cls, mamba_abstract.get_mamba_prefill_checkpoint_alignment,
             platform.__dict__.get("_find_non_ssm_backends"))
    ModelRegistry.resolve_model_cls = lambda arch, model_config=None: (ModelClass, arch)
    mamba_abstract.get_mamba_prefill_checkpoint_alignment = lambda vllm_config: 64 if gdn else None
    platform._find_non_ssm_backends = classmethod(lambda cls, vllm_config: [FlashAttentionLike])
    try:
        platform._align_hybrid_block_size(config, FlashAttentionLike)
    finally:
        ModelRegistry.resolve_model_cls, mamba_abstract.get_mamba_prefill_checkpoint_alignment = saved[:2]
        if saved[2] is None:
            del platform._find_non_ssm_backends
        else:
            platform._find_non_ssm_backends = saved[2]
    return config.cache_config.block_size


def vllm_scheduler(
    model: str,
    budget_bytes: int,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    reserve_full_isl: bool = True,
    prefix_caching: bool = False,
) -> tuple[Any, Any]:
    """vLLM's real v1 ``Scheduler`` for ``model`` at ``budget_bytes`` per GPU (prefix caching off,
    recompute, no watermark), and its ``KVCacheConfig``. ``reserve_full_isl``: vLLM's
    ``scheduler_reserve_full_isl`` (its default True: admit a request only when its whole prompt
    fits; False: when its first chunk does)."""
    _cpu()
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.scheduler import Scheduler as VScheduler
    from vllm.v1.structured_output import StructuredOutputManager

    spec = model_spec(model)
    # FlashInfer's GDN prefill (Qwen3-Next on Hopper) exports checkpoints on a 64-token grid
    gdn = any(getattr(layer, "mixer", "") == "gdn" for layer in spec.layers)
    block_size = vllm_aligned_block_size(model, prefix_caching)  # vLLM's own rule, not hybridkv's
    with tempfile.TemporaryDirectory(prefix="vllm_replay_") as model_dir:
        config = vllm_config(model_dir, max_num_seqs, max_num_batched_tokens, block_size, reserve_full_isl)
    if prefix_caching:
        c = config.cache_config
        c.enable_prefix_caching, c.mamba_cache_mode, c.mamba_block_size = True, "align", block_size
    layers = vllm_layer_specs(spec, block_size, align=prefix_caching, checkpoints=prefix_caching and gdn)
    groups = get_kv_cache_groups(config, layers)
    kv = get_kv_cache_config_from_groups(config, groups, budget_bytes)
    config.cache_config.num_gpu_blocks = kv.num_blocks
    scheduler_block, hash_block = resolve_kv_cache_block_sizes(kv, config)
    sched = VScheduler(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=scheduler_block,
        hash_block_size=hash_block,
    )
    return sched, kv


def replay_vllm(sched: Any, requests: Sequence[Req], max_steps: int = 1_000_000) -> Run:
    """Drive vLLM's scheduler: ``schedule()``, one fake token per row that reached its known
    tokens, ``update_from_output()``, until no request is left. With prefix caching the prompts are
    the trace's token ids (``Req.token_ids``), hashed by vLLM's default block hasher."""
    _cpu()
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    hasher = None
    if sched.cache_config.enable_prefix_caching:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        hash_fn = get_hash_fn_by_name(sched.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(sched.hash_block_size, hash_fn)
    hits = 0
    admitted: set[str] = set()  # running since their admission
    for r in requests:
        params = SamplingParams(max_tokens=r.max_new_tokens, ignore_eos=True)
        ids = list(r.token_ids) if r.token_ids is not None else [1] * r.num_prompt_tokens
        sched.add_request(Request(r.request_id, ids, params, None, block_hasher=hasher))
    steps: list[Step] = []
    while sched.has_requests() and len(steps) < max_steps:
        so = sched.schedule()
        if not so.total_num_scheduled_tokens and not so.preempted_req_ids:
            break  # finished requests drained in the last update: nothing left to run
        starts = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        # admitted (new or after a recompute) this step: they start at their prefix hit
        hits += sum(starts[i] for i in so.num_scheduled_tokens if i not in admitted)
        admitted.update(so.num_scheduled_tokens)
        admitted.difference_update(so.preempted_req_ids or ())
        rows = {rid: (starts[rid], n) for rid, n in so.num_scheduled_tokens.items()}
        steps.append(Step(rows, tuple(sorted(so.preempted_req_ids or ()))))
        ids = list(so.num_scheduled_tokens)
        # (schedule() already advanced num_computed_tokens by the scheduled tokens)
        sampled = [[7] if sched.requests[i].num_computed_tokens >= sched.requests[i].num_tokens else [] for i in ids]
        index = {r: i for i, r in enumerate(ids)}
        out = ModelRunnerOutput(req_ids=ids, req_id_to_index=index, sampled_token_ids=sampled)
        sched.update_from_output(so, out)
    return Run(steps, hits)


def first_difference(a: Run, b: Run) -> str | None:
    """Where two replays first schedule differently (None: identical at every step)."""
    for i, (x, y) in enumerate(zip(a.steps, b.steps, strict=False)):
        if x.rows != y.rows or sorted(x.preempted) != sorted(y.preempted):
            only_a = {k: v for k, v in x.rows.items() if y.rows.get(k) != v}
            only_b = {k: v for k, v in y.rows.items() if x.rows.get(k) != v}
            return f"step {i}: {only_a} / {only_b}; preempted {x.preempted} / {y.preempted}"
    if a.num_steps != b.num_steps:
        return f"{a.num_steps} steps against {b.num_steps}"
    return None
