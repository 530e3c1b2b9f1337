"""Layer builders and the model presets of ``docs/models.md``.

Builders turn published hyper-parameters into :class:`RecurrentLayerSpec` objects so that presets,
spec files and HuggingFace configs share one derivation (e.g. the Mamba2 conv width
``d_inner + 2 * n_groups * d_state``). ``state_dtype`` replaces the dtype of a layer's main state
(lightning ``kv``, ``ssm``, ``wkv``); ``conv_dtype`` the conv windows'.

Default dtypes of the presets of models transformers implements follow what transformers keeps in a
bf16 model (checked against transformers 5.24 on the CPU, ``tests/test_models_hf.py``): SSM and
delta-net states float32 whatever the model dtype, MiniMax's lightning state in the activation dtype
(bfloat16), conv windows and KV in the model dtype (bfloat16). Conv windows keep ``kernel - 1``
columns (see :mod:`hybridkv.models.spec`).
"""

from __future__ import annotations

from collections.abc import Callable

from hybridkv.errors import SpecError
from hybridkv.models.spec import (
    AttentionLayerSpec,
    DType,
    HybridLayerSpec,
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
    d_inner: int | None = None,
) -> RecurrentLayerSpec:
    """Mamba2: ``ssm [num_heads, head_dim, d_state]`` + ``conv [d_inner + 2*n_groups*d_state, conv_kernel-1]``.

    ``d_inner`` defaults to ``num_heads * head_dim``. Tensor parallelism splits heads; the conv's B
    and C channels (``2 * d_state`` per group) go whole to every rank whose heads use the group.
    """
    if n_groups <= 0 or num_heads % n_groups:
        raise SpecError(f"mamba2: num_heads {num_heads} must be a multiple of n_groups {n_groups}")
    inner = num_heads * head_dim if d_inner is None else d_inner
    conv_dim = inner + 2 * n_groups * d_state
    return RecurrentLayerSpec(
        "mamba2",
        (
            StateComponent("ssm", (num_heads, head_dim, d_state), ssm_dtype),
            StateComponent(
                "conv", (conv_dim, conv_kernel - 1), conv_dtype, tp_groups=(num_heads, n_groups, 2 * d_state)
            ),
        ),
    )


def mamba1_layer(
    d_inner: int,
    d_state: int,
    conv_kernel: int,
    ssm_dtype: DType | str = BF16,
    conv_dtype: DType | str = BF16,
    num_heads: int = 1,
) -> RecurrentLayerSpec:
    """Mamba (v1, Jamba): ``ssm [d_inner, d_state]`` + ``conv [d_inner, conv_kernel-1]``.

    ``num_heads`` > 1: Zamba (v1)'s multi-head Mamba-1, whose ``d_inner`` channels are split into
    independent heads: ``ssm [num_heads, d_inner / num_heads, d_state]`` (the same bytes); tensor
    parallelism splits the channels of every head (axis 1), as it splits ``d_inner`` for Mamba-1.
    """
    if num_heads <= 0 or d_inner % num_heads:
        raise SpecError(f"mamba: d_inner {d_inner} must be a multiple of the number of mamba heads {num_heads}")
    ssm = (
        StateComponent("ssm", (d_inner, d_state), ssm_dtype)
        if num_heads == 1
        else StateComponent("ssm", (num_heads, d_inner // num_heads, d_state), ssm_dtype, tp_axis=1)
    )
    return RecurrentLayerSpec("mamba", (ssm, StateComponent("conv", (d_inner, conv_kernel - 1), conv_dtype)))


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
    heads = (num_k_heads, num_v_heads)
    return RecurrentLayerSpec(
        "gdn",
        (
            StateComponent("ssm", (num_v_heads, k_head_dim, v_head_dim), ssm_dtype, tp_heads=heads),
            StateComponent("conv", (conv_dim, conv_kernel - 1), conv_dtype, tp_heads=heads),
        ),
    )


def kda_layer(
    num_heads: int, head_dim: int, conv_kernel: int, ssm_dtype: DType | str = FP32, conv_dtype: DType | str = BF16
) -> RecurrentLayerSpec:
    """Kimi Delta Attention (Kimi Linear): ``ssm [num_heads, head_dim, head_dim]`` + one conv window
    over q, k and v ``[3 * num_heads * head_dim, conv_kernel-1]``; heads split by tensor parallelism."""
    return RecurrentLayerSpec(
        "kda",
        (
            StateComponent("ssm", (num_heads, head_dim, head_dim), ssm_dtype),
            StateComponent("conv", (3 * num_heads * head_dim, conv_kernel - 1), conv_dtype),
        ),
    )


def mlstm_layer(num_heads: int, qk_head_dim: int, v_head_dim: int, dtype: DType | str = BF16) -> RecurrentLayerSpec:
    """xLSTM's mLSTM (transformers ``xlstm``): matrix memory ``c [num_heads, qk_head_dim, v_head_dim]``,
    normalizer ``n [num_heads, qk_head_dim]`` and stabilizer ``m [num_heads, 1]``; heads split by
    tensor parallelism."""
    return RecurrentLayerSpec(
        "mlstm",
        (
            StateComponent("c", (num_heads, qk_head_dim, v_head_dim), dtype),
            StateComponent("n", (num_heads, qk_head_dim), dtype),
            StateComponent("m", (num_heads, 1), dtype),
        ),
    )


def short_conv_layer(channels: int, conv_kernel: int, dtype: DType | str = BF16) -> RecurrentLayerSpec:
    """A gated short convolution whose only state is its window (LFM2): ``conv [channels, conv_kernel-1]``."""
    return RecurrentLayerSpec("short_conv", (StateComponent("conv", (channels, conv_kernel - 1), dtype),))


def rwkv4_layer(hidden_size: int, attention_size: int, dtype: DType | str = BF16) -> RecurrentLayerSpec:
    """RWKV-4 (transformers ``rwkv``): token shifts of time-mix and channel-mix (model dtype) and the
    WKV numerator, denominator and running maximum ``[attention_size]`` (float32)."""
    return RecurrentLayerSpec(
        "rwkv4",
        (
            StateComponent("shift_ffn", (hidden_size,), dtype),
            StateComponent("shift_attn", (hidden_size,), dtype),
            StateComponent("num", (attention_size,), FP32),
            StateComponent("den", (attention_size,), FP32),
            StateComponent("max", (attention_size,), FP32),
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


HF_SSM = "transformers keeps SSM / delta-net states in float32 whatever the model dtype"
HF_CONV = "the model dtype (transformers keeps conv windows and token shifts in it)"
MINIMAX_LIGHTNING = (
    "the activation dtype (transformers, vLLM and FastDeploy keep the lightning state in it; "
    "MiniMax's reference code: float32)"
)


def _minimax_m1(state_dtype: DType, conv_dtype: DType | None) -> ModelSpec:
    # MiniMax-M1 config.json (MiniMaxAI/MiniMax-M1-80k): 80 layers, attn_type_list softmax at 7, 15, ..
    pattern = "".join("A" if i % 8 == 7 else "R" for i in range(80))
    return ModelSpec(
        "minimax-m1",
        layers_from_pattern(pattern, AttentionLayerSpec(8, 128, BF16, 64), lightning_layer(64, 128, state_dtype)),
        hidden_size=6144,
        params_active=45.9e9,
        dtype_sources=(("kv", "bfloat16: the model dtype"),),
    )


def _gdn_preset(
    name: str, layers: int, attn: AttentionLayerSpec, gdn: tuple[int, int, int, int], hidden: int, active: float
) -> Callable[[DType, DType | None], ModelSpec]:
    def build(state_dtype: DType, conv_dtype: DType | None) -> ModelSpec:
        pattern = "".join("A" if i % 4 == 3 else "R" for i in range(layers))
        rec = gdn_layer(*gdn, 4, state_dtype, conv_dtype or BF16)
        return ModelSpec(name, layers_from_pattern(pattern, attn, rec), hidden_size=hidden, params_active=active)

    return build


# Qwen3-Next-80B-A3B config.json (Qwen/Qwen3-Next-80B-A3B-Instruct): 48 layers, full_attention_interval 4,
# 16 q / 2 kv heads x 256, linear 16 key / 32 value heads x 128, linear_conv_kernel_dim 4
_qwen3_next = _gdn_preset("qwen3-next-80b-a3b", 48, AttentionLayerSpec(2, 256, BF16, 16), (16, 32, 128, 128), 2048, 3e9)
# Qwen3.5-27B config.json text_config (Qwen/Qwen3.5-27B): 64 layers, full_attention_interval 4,
# 24 q / 4 kv heads x 256, linear 16 key / 48 value heads x 128, conv 4, hidden 5120
_qwen35_27b = _gdn_preset("qwen3.5-27b", 64, AttentionLayerSpec(4, 256, BF16, 24), (16, 48, 128, 128), 5120, 27e9)
# Qwen3.5-35B-A3B config.json text_config (Qwen/Qwen3.5-35B-A3B, qwen3_5_moe_text): 40 layers, interval 4,
# 16 q / 2 kv heads x 256, linear 16 key / 32 value heads x 128, conv 4, hidden 2048
_qwen35_35b = _gdn_preset("qwen3.5-35b-a3b", 40, AttentionLayerSpec(2, 256, BF16, 16), (16, 32, 128, 128), 2048, 3e9)


def _kimi_linear_48b(state_dtype: DType, conv_dtype: DType | None) -> ModelSpec:
    # Kimi-Linear-48B-A3B config.json (moonshotai/Kimi-Linear-48B-A3B-Instruct): 27 layers,
    # linear_attn_config full_attn_layers [4, 8, 12, 16, 20, 24, 27] (1-based) = MLA, the other 20 KDA
    # (num_heads 32, head_dim 128, short_conv_kernel_size 4); MLA kv_lora_rank 512, qk_rope_head_dim 64
    mla = {3, 7, 11, 15, 19, 23, 26}
    pattern = "".join("A" if i in mla else "R" for i in range(27))
    attn = AttentionLayerSpec(1, 512, BF16, 32, v_head_dim=64)  # latent 512 + rotary key 64, one head
    return ModelSpec(
        "kimi-linear-48b-a3b",
        layers_from_pattern(pattern, attn, kda_layer(32, 128, 4, state_dtype, conv_dtype or BF16)),
        hidden_size=2304,
        params_active=3e9,
    )


NEMOTRON_H_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"


def _nemotron_h_8b(state_dtype: DType, conv_dtype: DType | None) -> ModelSpec:
    return ModelSpec(
        "nemotron-h-8b",
        layers_from_pattern(
            NEMOTRON_H_8B_PATTERN,
            AttentionLayerSpec(8, 128, BF16, 32),
            mamba2_layer(128, 64, 128, 8, 4, state_dtype, conv_dtype or BF16),
        ),
        hidden_size=4096,
        params_active=8e9,
    )


def _jamba_15_mini(state_dtype: DType, conv_dtype: DType | None) -> ModelSpec:
    pattern = "".join("A" if i % 8 == 4 else "R" for i in range(32))
    return ModelSpec(
        "jamba-1.5-mini",
        layers_from_pattern(
            pattern, AttentionLayerSpec(8, 128, BF16, 32), mamba1_layer(8192, 16, 4, state_dtype, conv_dtype or BF16)
        ),
        hidden_size=4096,
        params_active=12e9,
    )


def _mamba2_27b(state_dtype: DType, conv_dtype: DType | None) -> ModelSpec:
    return ModelSpec(
        "mamba2-2.7b",
        layers_from_pattern("R" * 64, None, mamba2_layer(80, 64, 128, 1, 4, state_dtype, conv_dtype or BF16)),
        hidden_size=2560,
        params_active=2.7e9,
    )


def _rwkv7_15b(state_dtype: DType, conv_dtype: DType | None) -> ModelSpec:
    return ModelSpec(
        "rwkv7-1.5b",
        layers_from_pattern("R" * 24, None, rwkv_layer(32, 64, 2048, state_dtype, conv_dtype or BF16)),
        hidden_size=2048,
        params_active=1.5e9,
    )


def _gla_13b(state_dtype: DType, conv_dtype: DType | None) -> ModelSpec:
    return ModelSpec(
        "gla-1.3b",
        layers_from_pattern("R" * 24, None, gla_layer(4, 256, 512, state_dtype)),
        hidden_size=2048,
        params_active=1.3e9,
    )


def _retnet_7b(state_dtype: DType, conv_dtype: DType | None) -> ModelSpec:
    return ModelSpec(
        "retnet-7b",
        layers_from_pattern("R" * 32, None, retention_layer(16, 256, 432, state_dtype)),
        hidden_size=4096,
        params_active=6.7e9,
    )


def _falcon_h1_7b(state_dtype: DType, conv_dtype: DType | None) -> ModelSpec:
    # Falcon-H1-7B (tiiuae/Falcon-H1-7B-Instruct): depth 44, dim 3072, 12 attention / 2 KV heads, 24 Mamba
    # heads, d_head 128 / 128, d_state 256 (huggingface/transformers docs/source/en/model_doc/falcon_h1.md,
    # FalconH1Config table); mamba_d_ssm 3072, mamba_n_groups 1, mamba_d_conv 4, head_dim 128 (its config.json
    # as public test fixtures quote it, e.g. mlx-community/Falcon-H1-7B-Instruct-4bit). Every layer keeps K/V
    # and a Mamba2 state.
    rec = mamba2_layer(24, 128, 256, 1, 4, state_dtype, conv_dtype or BF16, d_inner=3072)
    return ModelSpec(
        "falcon-h1-7b",
        (HybridLayerSpec(AttentionLayerSpec(2, 128, BF16, 12), rec),) * 44,
        hidden_size=3072,
        params_active=7e9,
    )


def _zamba2(
    name: str, layers: int, hybrid: tuple[int, ...], hidden: int, heads: int, mamba: tuple[int, int, int], active: float
) -> Callable[[DType, DType | None], ModelSpec]:
    """Zamba2: Mamba2 layers (``mamba_expand`` 2, head dim 64, d_conv 4), the ``hybrid`` ones also keeping
    the shared block's K/V (MHA, ``attention_head_dim = 2 * hidden / heads``), as the HF reader gives."""

    def build(state_dtype: DType, conv_dtype: DType | None) -> ModelSpec:
        mamba_heads, groups, d_state = mamba
        rec = mamba2_layer(mamba_heads, 64, d_state, groups, 4, state_dtype, conv_dtype or BF16, d_inner=2 * hidden)
        layer = HybridLayerSpec(AttentionLayerSpec(heads, 2 * hidden // heads, BF16, heads), rec)
        spec = tuple(layer if i in hybrid else rec for i in range(layers))
        return ModelSpec(name, spec, hidden_size=hidden, params_active=active)

    return build


# Zamba2 (sources: docs/models.md "Zamba2"). Dims (hidden, layers, mamba / hybrid counts, attention heads / KV
# heads / head dim, mamba heads / head dim / groups, d_state): the checkpoint sweep of public config.json files
# in dinoml's transformers audit of zamba2 (Zyphra/Zamba2-1.2B, -2.7B, -7B-Instruct). Hybrid positions:
# 7B: the layers_block_type of its config.json as NX-AI's xLSTM benchmark vendors it (hidden 3584, 81 layers,
# mamba_ngroups 2, state_size 64, torch_dtype bfloat16); 2.7B: layer_mapping ("g") of Zyphra/Zamba2's
# config.json @89a404b (54 layers, hidden 2560, state_size 64, conv_dimension 4, expansion_factor 2);
# 1.2B: layers_block_type of Zyphra/Zamba2-1.2B's config.json @6b05bf29 as a public trace report of it lists it
# (d_state 128, 64 mamba heads x 64, 1 group, d_conv 4, 38 layers).
_zamba2_7b = _zamba2("zamba2-7b", 81, (6, *range(11, 81, 6)), 3584, 32, (112, 2, 64), 7e9)
_zamba2_27b = _zamba2("zamba2-2.7b", 54, (6, 12, 18, 24, 30, 36, 42, 47, 51), 2560, 32, (80, 1, 64), 2.7e9)
_zamba2_12b = _zamba2("zamba2-1.2b", 38, tuple(range(5, 38, 6)), 2048, 32, (64, 1, 128), 1.2e9)

# name -> (builder, default dtype of the main state, where that default comes from)
_PRESETS: dict[str, tuple[Callable[[DType, DType | None], ModelSpec], DType, str]] = {
    # MiniMax-M1's lightning state in the activation dtype, as transformers (MiniMaxCache), vLLM and
    # FastDeploy keep it; the HF reader (model_type minimax) gives the same. MiniMax's own reference code
    # accumulates it in float32: --state-dtype float32 for those bytes (twice the state).
    "minimax-m1": (_minimax_m1, BF16, MINIMAX_LIGHTNING),
    "qwen3-next-80b-a3b": (_qwen3_next, FP32, HF_SSM),
    "nemotron-h-8b": (_nemotron_h_8b, FP32, HF_SSM + " (NemotronHConfig mamba_ssm_cache_dtype float32)"),
    "jamba-1.5-mini": (_jamba_15_mini, FP32, HF_SSM),
    "mamba2-2.7b": (_mamba2_27b, FP32, HF_SSM),
    "rwkv7-1.5b": (_rwkv7_15b, FP32, "fla / RWKV-7 reference keeps wkv in float32 (not in transformers)"),
    "gla-1.3b": (_gla_13b, BF16, "the model dtype (fla GLA; not in transformers)"),
    "retnet-7b": (_retnet_7b, DType.FLOAT16, "torchscale retnet_7b runs in float16 (not in transformers)"),
    "qwen3.5-27b": (_qwen35_27b, FP32, HF_SSM),
    "qwen3.5-35b-a3b": (_qwen35_35b, FP32, HF_SSM),
    "kimi-linear-48b-a3b": (_kimi_linear_48b, FP32, HF_SSM),
    "falcon-h1-7b": (_falcon_h1_7b, FP32, HF_SSM),
    "zamba2-7b": (_zamba2_7b, FP32, HF_SSM),
    "zamba2-2.7b": (_zamba2_27b, FP32, HF_SSM),
    "zamba2-1.2b": (_zamba2_12b, FP32, HF_SSM),
}
_ALIASES = {
    "minimax-text-01": "minimax-m1",
    "qwen3-next": "qwen3-next-80b-a3b",
    "nemotron-h": "nemotron-h-8b",
    "kimi-linear": "kimi-linear-48b-a3b",
    "falcon-h1": "falcon-h1-7b",
    "zamba2": "zamba2-7b",
}

PRESET_NAMES: tuple[str, ...] = tuple(_PRESETS)


def default_state_dtype(name: str) -> DType:
    """The main-state dtype a preset uses when none is asked for."""
    return _PRESETS[_canonical(name)][1]


def _main_component(mixer: str) -> str:
    return {"lightning": "kv", "rwkv": "wkv", "gla": "kv", "retention": "kv"}.get(mixer, "ssm")


def _canonical(name: str) -> str:
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in _PRESETS:
        raise SpecError(
            f"unknown model {name!r}: use one of {', '.join(PRESET_NAMES)}, or a spec file (.json/.toml/config.json)"
        )
    return key


def preset(
    name: str, state_dtype: DType | str | None = None, tp_size: int = 1, conv_dtype: DType | str | None = None
) -> ModelSpec:
    """The preset ``name`` with its main state in ``state_dtype`` and its conv windows (or token
    shifts) in ``conv_dtype`` (defaults per model, see :func:`default_state_dtype`), sharded to ``tp_size``.

    The result's ``dtype_sources`` say where each dtype came from. Raises :class:`SpecError` for an
    unknown name and :class:`TensorParallelError` when ``tp_size`` does not divide the model's heads
    or channels.
    """
    key = _canonical(name)
    builder, default, why = _PRESETS[key]
    dtype = default if state_dtype is None else DType.parse(state_dtype, quantized=True)
    conv = None if conv_dtype is None else DType.parse(conv_dtype)
    spec = builder(dtype, conv)
    sources: dict[str, str] = {}
    if spec.attention_layer_ids:
        sources["kv"] = "bfloat16: the model dtype"
    for _, layer in spec.recurrent_layers():
        for c in layer.components:
            k = f"{layer.mixer}.{c.name}"
            if k in sources:
                continue
            if c.name == _main_component(layer.mixer):
                sources[k] = f"{c.dtype.value}: " + ("--state-dtype" if state_dtype is not None else why)
            elif c.name.startswith(("conv", "shift")):
                sources[k] = f"{c.dtype.value}: " + ("--conv-dtype" if conv is not None else HF_CONV)
            else:
                sources[k] = f"{c.dtype.value}: fixed by the model"
    spec = ModelSpec(
        spec.name,
        spec.layers,
        hidden_size=spec.hidden_size,
        params_active=spec.params_active,
        notes=spec.notes,
        dtype_sources=tuple(sources.items()),
    )
    return spec.shard(tp_size)


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
    "qwen3.5-27b": 27e9,  # model card: 27B dense
    "qwen3.5-35b-a3b": 35e9,  # model card: 35B total, 3B active
    "kimi-linear-48b-a3b": 48e9,  # model card: 48B total, 3B active
    "falcon-h1-7b": 7e9,  # model card / transformers docs: H1 7B (dense)
    "zamba2-7b": 7e9,  # the model's name (dense); no parameter count in the sources found
    "zamba2-2.7b": 2.7e9,  # the model's name (dense)
    "zamba2-1.2b": 1.22e9,  # the trace report of Zyphra/Zamba2-1.2B: 1.22B total (dense)
}

GPU_MEMORY_BYTES: dict[str, int] = {
    # total device memory as nvidia-smi / torch.cuda.mem_get_info report it (what vLLM's
    # --gpu-memory-utilization multiplies); the marketed "141 GB" / "80 GB" are these, rounded
    "h200": 143771 * 2**20,
    "h100": 81559 * 2**20,
    "a100": 81920 * 2**20,
}

WEIGHT_DTYPE_BYTES: dict[str, float] = {"bfloat16": 2.0, "float16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
DEFAULT_TP_GPU = "h200"  # the GPU assumed where none is named (default TP, plan and simulate budgets)
DEFAULT_GPU_UTILIZATION = 0.9  # share of a GPU's memory an engine may use (vLLM's default)
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
