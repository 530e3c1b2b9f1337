"""Layer builders and the model presets of ``docs/models.md``.

Builders turn published hyper-parameters into :class:`RecurrentLayerSpec` objects so that presets,
spec files and HuggingFace configs share one derivation (e.g. the Mamba2 conv width
``d_inner + 2 * n_groups * d_state``). ``state_dtype`` replaces the dtype of a layer's main state
(lightning ``kv``, ``ssm``, ``wkv``); conv windows and token shifts keep the activation dtype, as
engines store them.
"""

from __future__ import annotations

from collections.abc import Callable

from hybridkv.errors import SpecError
from hybridkv.models.spec import (
    AttentionLayerSpec,
    DType,
    LayerSpec,
    ModelSpec,
    NoCacheLayerSpec,
    RecurrentLayerSpec,
    StateComponent,
)

BF16 = DType.BFLOAT16
FP32 = DType.FLOAT32


def lightning_layer(num_heads: int, head_dim: int, dtype: DType | str = FP32) -> RecurrentLayerSpec:
    """MiniMax lightning attention: state ``kv [num_heads, head_dim, head_dim]``."""
    return RecurrentLayerSpec("lightning", (StateComponent("kv", (num_heads, head_dim, head_dim), dtype),))


def mamba2_layer(
    num_heads: int,
    head_dim: int,
    d_state: int,
    n_groups: int,
    conv_kernel: int,
    ssm_dtype: DType | str = BF16,
    conv_dtype: DType | str = BF16,
) -> RecurrentLayerSpec:
    """Mamba2: ``ssm [num_heads, head_dim, d_state]`` + ``conv [d_inner + 2*n_groups*d_state, conv_kernel-1]``."""
    conv_dim = num_heads * head_dim + 2 * n_groups * d_state
    return RecurrentLayerSpec(
        "mamba2",
        (
            StateComponent("ssm", (num_heads, head_dim, d_state), ssm_dtype),
            StateComponent("conv", (conv_dim, conv_kernel - 1), conv_dtype),
        ),
    )


def mamba1_layer(
    d_inner: int,
    d_state: int,
    conv_kernel: int,
    ssm_dtype: DType | str = BF16,
    conv_dtype: DType | str = BF16,
) -> RecurrentLayerSpec:
    """Mamba (v1, Jamba): ``ssm [d_inner, d_state]`` + ``conv [d_inner, conv_kernel-1]``."""
    return RecurrentLayerSpec(
        "mamba",
        (
            StateComponent("ssm", (d_inner, d_state), ssm_dtype),
            StateComponent("conv", (d_inner, conv_kernel - 1), conv_dtype),
        ),
    )


def gdn_layer(
    num_k_heads: int,
    num_v_heads: int,
    k_head_dim: int,
    v_head_dim: int,
    conv_kernel: int,
    ssm_dtype: DType | str = BF16,
    conv_dtype: DType | str = BF16,
) -> RecurrentLayerSpec:
    """Gated DeltaNet (Qwen3-Next): ``ssm [num_v_heads, k_head_dim, v_head_dim]`` + conv over q, k, v."""
    conv_dim = 2 * num_k_heads * k_head_dim + num_v_heads * v_head_dim
    return RecurrentLayerSpec(
        "gdn",
        (
            StateComponent("ssm", (num_v_heads, k_head_dim, v_head_dim), ssm_dtype),
            StateComponent("conv", (conv_dim, conv_kernel - 1), conv_dtype),
        ),
    )


def rwkv_layer(
    num_heads: int, head_size: int, hidden_size: int, wkv_dtype: DType | str = FP32, shift_dtype: DType | str = BF16
) -> RecurrentLayerSpec:
    """RWKV-6/7: ``wkv [num_heads, head_size, head_size]`` + token shifts of time-mix and channel-mix."""
    return RecurrentLayerSpec(
        "rwkv",
        (
            StateComponent("wkv", (num_heads, head_size, head_size), wkv_dtype),
            StateComponent("shift_attn", (hidden_size,), shift_dtype),
            StateComponent("shift_ffn", (hidden_size,), shift_dtype),
        ),
    )


def gla_layer(num_heads: int, k_head_dim: int, v_head_dim: int, dtype: DType | str = BF16) -> RecurrentLayerSpec:
    """Gated linear attention: ``kv [num_heads, k_head_dim, v_head_dim]``."""
    return RecurrentLayerSpec("gla", (StateComponent("kv", (num_heads, k_head_dim, v_head_dim), dtype),))


def retention_layer(
    num_heads: int, k_head_dim: int, v_head_dim: int, dtype: DType | str = DType.FLOAT16
) -> RecurrentLayerSpec:
    """RetNet retention: ``kv [num_heads, k_head_dim, v_head_dim]`` + a per-head fp32 ``scale``."""
    return RecurrentLayerSpec(
        "retention",
        (
            StateComponent("kv", (num_heads, k_head_dim, v_head_dim), dtype),
            StateComponent("scale", (num_heads,), FP32),
        ),
    )


def layers_from_pattern(
    pattern: str, attention: AttentionLayerSpec | None, recurrent: RecurrentLayerSpec | None
) -> tuple[LayerSpec, ...]:
    """Expand a pattern string: ``A``/``*`` attention, ``R``/``M`` recurrent, ``-``/``E`` no cache."""
    layers: list[LayerSpec] = []
    for i, ch in enumerate(pattern):
        if ch in "A*":
            if attention is None:
                raise SpecError(f"pattern position {i} is attention but no attention layer was given")
            layers.append(attention)
        elif ch in "RM":
            if recurrent is None:
                raise SpecError(f"pattern position {i} is recurrent but no recurrent layer was given")
            layers.append(recurrent)
        elif ch in "-E":
            layers.append(NoCacheLayerSpec())
        else:
            raise SpecError(f"pattern character {ch!r} at {i}: use A or * (attention), R or M (recurrent), - (none)")
    return tuple(layers)


def _minimax_m1(state_dtype: DType) -> ModelSpec:
    pattern = "".join("A" if i % 8 == 7 else "R" for i in range(80))
    return ModelSpec(
        "minimax-m1",
        layers_from_pattern(pattern, AttentionLayerSpec(8, 128, BF16, 64), lightning_layer(64, 128, state_dtype)),
        hidden_size=6144,
        params_active=45.9e9,
    )


def _qwen3_next(state_dtype: DType) -> ModelSpec:
    pattern = "".join("A" if i % 4 == 3 else "R" for i in range(48))
    return ModelSpec(
        "qwen3-next-80b-a3b",
        layers_from_pattern(pattern, AttentionLayerSpec(2, 256, BF16, 16), gdn_layer(16, 32, 128, 128, 4, state_dtype)),
        hidden_size=2048,
        params_active=3e9,
    )


NEMOTRON_H_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"


def _nemotron_h_8b(state_dtype: DType) -> ModelSpec:
    return ModelSpec(
        "nemotron-h-8b",
        layers_from_pattern(
            NEMOTRON_H_8B_PATTERN, AttentionLayerSpec(8, 128, BF16, 32), mamba2_layer(128, 64, 128, 8, 4, state_dtype)
        ),
        hidden_size=4096,
        params_active=8e9,
    )


def _jamba_15_mini(state_dtype: DType) -> ModelSpec:
    pattern = "".join("A" if i % 8 == 4 else "R" for i in range(32))
    return ModelSpec(
        "jamba-1.5-mini",
        layers_from_pattern(pattern, AttentionLayerSpec(8, 128, BF16, 32), mamba1_layer(8192, 16, 4, state_dtype)),
        hidden_size=4096,
        params_active=12e9,
    )


def _mamba2_27b(state_dtype: DType) -> ModelSpec:
    return ModelSpec(
        "mamba2-2.7b",
        layers_from_pattern("R" * 64, None, mamba2_layer(80, 64, 128, 1, 4, state_dtype)),
        hidden_size=2560,
        params_active=2.7e9,
    )


def _rwkv7_15b(state_dtype: DType) -> ModelSpec:
    return ModelSpec(
        "rwkv7-1.5b",
        layers_from_pattern("R" * 24, None, rwkv_layer(32, 64, 2048, state_dtype)),
        hidden_size=2048,
        params_active=1.5e9,
    )


def _gla_13b(state_dtype: DType) -> ModelSpec:
    return ModelSpec(
        "gla-1.3b",
        layers_from_pattern("R" * 24, None, gla_layer(4, 256, 512, state_dtype)),
        hidden_size=2048,
        params_active=1.3e9,
    )


def _retnet_7b(state_dtype: DType) -> ModelSpec:
    return ModelSpec(
        "retnet-7b",
        layers_from_pattern("R" * 32, None, retention_layer(16, 256, 432, state_dtype)),
        hidden_size=4096,
        params_active=6.7e9,
    )


# name -> (builder, default dtype of the main state)
_PRESETS: dict[str, tuple[Callable[[DType], ModelSpec], DType]] = {
    "minimax-m1": (_minimax_m1, FP32),
    "qwen3-next-80b-a3b": (_qwen3_next, BF16),
    "nemotron-h-8b": (_nemotron_h_8b, BF16),
    "jamba-1.5-mini": (_jamba_15_mini, BF16),
    "mamba2-2.7b": (_mamba2_27b, BF16),
    "rwkv7-1.5b": (_rwkv7_15b, FP32),
    "gla-1.3b": (_gla_13b, BF16),
    "retnet-7b": (_retnet_7b, DType.FLOAT16),
}
_ALIASES = {"minimax-text-01": "minimax-m1", "qwen3-next": "qwen3-next-80b-a3b", "nemotron-h": "nemotron-h-8b"}

PRESET_NAMES: tuple[str, ...] = tuple(_PRESETS)


def default_state_dtype(name: str) -> DType:
    """The main-state dtype a preset uses when none is asked for."""
    return _PRESETS[_canonical(name)][1]


def _canonical(name: str) -> str:
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in _PRESETS:
        raise SpecError(
            f"unknown model {name!r}: use one of {', '.join(PRESET_NAMES)}, or a spec file (.json/.toml/config.json)"
        )
    return key


def preset(name: str, state_dtype: DType | str | None = None, tp_size: int = 1) -> ModelSpec:
    """The preset ``name`` with its main state in ``state_dtype`` (default per model), sharded to ``tp_size``.

    Raises :class:`SpecError` for an unknown name and :class:`TensorParallelError` when ``tp_size``
    does not divide the model's heads or channels.
    """
    key = _canonical(name)
    builder, default = _PRESETS[key]
    dtype = default if state_dtype is None else DType.parse(state_dtype)
    return builder(dtype).shard(tp_size)


# ---- deployment facts the planner uses: total parameters, GPU memory, default TP -----------------
PARAMS_TOTAL: dict[str, float] = {
    # total parameters (all MoE experts), as the model cards publish them; weights on a GPU are
    # params_total * bytes per weight / tp (experts and embeddings are divided like everything else)
    "minimax-m1": 456e9,
    "qwen3-next-80b-a3b": 80e9,
    "nemotron-h-8b": 8e9,
    "jamba-1.5-mini": 52e9,
    "mamba2-2.7b": 2.7e9,
    "rwkv7-1.5b": 1.5e9,
    "gla-1.3b": 1.3e9,
    "retnet-7b": 6.7e9,
}

GPU_MEMORY_BYTES: dict[str, int] = {
    # total device memory as nvidia-smi / torch.cuda.mem_get_info report it (what vLLM's
    # --gpu-memory-utilization multiplies); the marketed "141 GB" / "80 GB" are these, rounded
    "h200": 143771 * 2**20,
    "h100": 81559 * 2**20,
    "a100": 81920 * 2**20,
}

WEIGHT_DTYPE_BYTES: dict[str, float] = {"bfloat16": 2.0, "float16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
DEFAULT_TP_GPU = "h200"
DEFAULT_TP_WEIGHT_FRACTION = 0.8
TP_CHOICES = (1, 2, 4, 8, 16, 32, 64)


def params_total(name: str) -> float:
    """Total parameters of a preset (all experts): the weights a deployment holds."""
    return PARAMS_TOTAL[_canonical(name)]


def gpu_memory_bytes(gpu: str) -> int:
    """Total memory of a named GPU (``h200``, ``h100``, ``a100``); :class:`SpecError` otherwise."""
    key = gpu.strip().lower()
    if key not in GPU_MEMORY_BYTES:
        raise SpecError(f"unknown GPU {gpu!r}: use one of {', '.join(GPU_MEMORY_BYTES)} (or give --gpu-memory SIZE)")
    return GPU_MEMORY_BYTES[key]


def weight_bytes_per_gpu(name: str, tp_size: int, weight_dtype: str = "bfloat16") -> int:
    """Weight bytes one of ``tp_size`` GPUs holds: ``params_total * bytes per weight / tp_size``."""
    if weight_dtype not in WEIGHT_DTYPE_BYTES:
        raise SpecError(f"unknown weight dtype {weight_dtype!r}: use one of {', '.join(WEIGHT_DTYPE_BYTES)}")
    return int(params_total(name) * WEIGHT_DTYPE_BYTES[weight_dtype] / tp_size)


def default_tp(name: str, gpu: str = DEFAULT_TP_GPU, weight_dtype: str = "bfloat16") -> int:
    """The smallest TP (1, 2, 4, ... 64) that divides the preset and at which its weights take at most
    80% of one ``gpu``'s memory, leaving the rest for cache and activations (MiniMax-M1 on H200: 8,
    Qwen3-Next-80B-A3B: 2, the 1-8 B models: 1)."""
    limit = DEFAULT_TP_WEIGHT_FRACTION * gpu_memory_bytes(gpu)
    for tp in TP_CHOICES:
        if weight_bytes_per_gpu(name, tp, weight_dtype) > limit:
            continue
        try:
            preset(name, None, tp)
        except SpecError:
            continue
        return tp
    raise SpecError(f"{name}: no TP up to {TP_CHOICES[-1]} fits its weights on one {gpu}")
