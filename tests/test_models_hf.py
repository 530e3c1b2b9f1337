"""The HF readers against transformers itself (the oracle): for each family a tiny model is built
from its config class with random weights (bf16, CPU), run for a short prefill and one decode, and
the cache tensors transformers keeps per layer are compared with what ``load_spec`` reads from the
``config.json`` that transformers wrote: layer kinds, component shapes (conv with ``kernel - 1``
columns here, ``kernel`` in transformers) and dtypes.

Skips (with the reason) when transformers or torch is not installed: ``pip install 'hybridkv[tests]'``.
"""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the HF oracle tests need torch (pip install 'hybridkv[torch]')")
transformers = pytest.importorskip(
    "transformers", reason="the HF oracle tests need transformers==5.24.0 (pip install 'hybridkv[tests]')"
)

from hybridkv.errors import SpecError  # noqa: E402
from hybridkv.models.hf import NOT_DESCRIBED, READERS, spec_from_hf_config  # noqa: E402
from hybridkv.models.spec import (  # noqa: E402
    AttentionLayerSpec,
    HybridLayerSpec,
    NoCacheLayerSpec,
    RecurrentLayerSpec,
    with_conv_columns,
)
from hybridkv.models.spec_file import load_spec  # noqa: E402

PINNED = "5.24.0"
from tests.hf_tiny_configs import CASES  # noqa: E402

HF_CONV_STATES = ("qk_window", "ple_window", "ngram_ids")
# transformers model types whose text model has no causal-LM head class: the oracle runs the base model
BASE_MODEL_ONLY = ("glm5_next_text",)


def _quiet():
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")


def _run_tiny(model_type: str, tmp: Path) -> tuple[list[dict], Path]:
    """Per decoder layer, what transformers keeps after a 5-token prefill and one decode:
    ``{"k": (heads, width, dtype), "v": ..., "conv": [(shape, dtype)], "state": [(shape, dtype)]}``
    (shapes without the batch axis); and the directory of the config.json transformers wrote."""
    _quiet()
    cfg = transformers.CONFIG_MAPPING[model_type](pad_token_id=0, **CASES[model_type])
    torch.manual_seed(0)
    auto = transformers.AutoModel if model_type in BASE_MODEL_ONLY else transformers.AutoModelForCausalLM
    model = auto.from_config(cfg, dtype=torch.bfloat16).eval()
    model.config.save_pretrained(tmp)
    ids = torch.randint(1, 100, (1, 5))
    with torch.no_grad():
        if model_type == "recurrent_gemma":  # its output carries no cache and its blocks keep their state
            cache = transformers.DynamicCache(config=model.config)  # on the module: pass the cache in
            for step in (ids, ids[:, :1]):
                model(step, cache=cache, use_cache=True)
            pairs = zip(model.model.layers, cache.layers, strict=True)
            return [_recurrent_gemma_layer(block, layer) for block, layer in pairs], tmp
        out = model(ids, use_cache=True)
        if model_type == "rwkv":
            out = model(ids[:, :1], state=out.state, use_cache=True)
            state = out.state  # five [batch, hidden, layers] tensors
            n = cfg.num_hidden_layers
            return [{"state": [(tuple(s[0, :, i].shape), s.dtype) for s in state]} for i in range(n)], tmp
        if model_type == "xlstm":  # xLSTMCache: rnn_state[layer] = (C, n, m), each [batch, ...]
            rnn = model(ids[:, :1], cache=out.cache, use_cache=True).cache.rnn_state
            return [{"state": [(tuple(t.shape[1:]), t.dtype) for t in rnn[i]]} for i in sorted(rnn)], tmp
        # transformers 5 names the argument cache (past_key_values deprecated; some models take only cache)
        arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        cache = model(ids[:, :1], **{arg: _cache_of(out)}, use_cache=True)
        cache = _cache_of(cache)
    layers = []
    linear = getattr(cache, "linear_cache", None)  # MiniMaxCache keeps lightning states beside its layers
    for i, layer in enumerate(cache.layers):
        d: dict = {}
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        sliding = getattr(layer, "is_sliding", False)
        if torch.is_tensor(keys) and not sliding:
            assert keys.shape[2] == 6, f"layer {i} holds {keys.shape[2]} tokens: the decode did not reuse the cache"
            d["k"] = (keys.shape[1], keys.shape[3], keys.dtype)
            d["v"] = (values.shape[1], values.shape[3], values.dtype)
        side = []  # DynamicIndexedLayer: indexer keys [batch, tokens, width], positions [3, batch, tokens]
        for attr, width_of in (("indexer_keys", lambda t: t.shape[2]), ("indexer_position_ids", lambda t: t.shape[0])):
            t = getattr(layer, attr, None)
            if torch.is_tensor(t):
                tokens = t.shape[1] if attr == "indexer_keys" else t.shape[2]
                assert tokens == 6, f"layer {i} {attr} holds {tokens} tokens"
                side.append((width_of(t), t.dtype))
        if side:
            d["side"] = side
        for name, attr in (("conv", "conv_states"), ("state", "recurrent_states")):
            ts = getattr(layer, attr, None)
            ts = list(ts.values()) if isinstance(ts, dict) else ts
            if ts:
                d[name] = [(tuple(t.shape[1:]), t.dtype) for t in ts if torch.is_tensor(t)]
        if linear and i < len(linear) and torch.is_tensor(linear[i]):
            d["state"] = [(tuple(linear[i].shape[1:]), linear[i].dtype)]
        if sliding:  # the window it keeps between steps: [kv heads, tokens, head dim] after the state
            d["state"] = [*d.get("state", []), *((tuple(t.shape[1:]), t.dtype) for t in (keys, values))]
        layers.append({k: v for k, v in d.items() if v})
    return layers, tmp


def _cache_of(out):
    """The cache a forward returned (base models of transformers 5 name it ``cache``)."""
    cache = getattr(out, "past_key_values", None)
    return cache if cache is not None else out.cache


def _recurrent_gemma_layer(block, layer) -> dict:
    temporal = block.temporal_block
    if getattr(layer, "is_sliding", False):
        return {"state": [(tuple(t.shape[1:]), t.dtype) for t in (layer.keys, layer.values)]}
    conv, lru = temporal.conv1d_state, temporal.rg_lru.recurrent_states
    return {"conv": [(tuple(conv.shape[1:]), conv.dtype)], "state": [(tuple(lru.shape[1:]), lru.dtype)]}


def _torch(dtype) -> torch.dtype:
    return getattr(torch, dtype.value)


def _expected(layer) -> dict:
    """What a hybridkv layer spec says transformers keeps (conv with kernel columns)."""
    out: dict = {}
    attn = layer.attention if isinstance(layer, HybridLayerSpec) else layer
    rec = layer.recurrent if isinstance(layer, HybridLayerSpec) else layer
    if isinstance(attn, AttentionLayerSpec):
        out["k"] = (attn.num_kv_heads, attn.head_dim, _torch(attn.dtype))
        out["v"] = (attn.num_kv_heads, attn.value_head_dim, _torch(attn.dtype))
        if attn.side:
            out["side"] = [(t.width, _torch(t.dtype)) for t in attn.side]
    if isinstance(rec, RecurrentLayerSpec):
        is_conv = [c.name.startswith(("conv", *HF_CONV_STATES)) for c in rec.components]
        conv = [(c.shape, _torch(c.dtype)) for c, k in zip(rec.components, is_conv, strict=True) if k]
        state = [(c.shape, _torch(c.dtype)) for c, k in zip(rec.components, is_conv, strict=True) if not k]
        if conv:
            out["conv"] = conv
        if state:
            out["state"] = state
    return out


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_load_spec_matches_the_cache_transformers_keeps(model_type, tmp_path):
    hf, path = _run_tiny(model_type, tmp_path)
    spec = load_spec(path)
    assert len(spec.layers) == len(hf)
    # transformers keeps kernel conv columns, except RecurrentGemma's blocks (kernel - 1, as hybridkv)
    kernel = spec if model_type == "recurrent_gemma" else with_conv_columns(spec, "kernel")
    for i, (ours, theirs) in enumerate(zip(kernel.layers, hf, strict=True)):
        if isinstance(ours, NoCacheLayerSpec):
            assert theirs == {}, f"layer {i}: transformers keeps {theirs}, the spec says nothing"
            continue
        exp = _expected(ours)
        if model_type == "rwkv":  # transformers keeps the five vectors in one order: shifts, num, den, max
            exp = {"state": exp["state"]}
        assert exp == theirs, f"{model_type} layer {i}"
        attn = ours.attention if isinstance(ours, HybridLayerSpec) else ours
        if isinstance(attn, AttentionLayerSpec):  # bytes per token: K, V and side tensors as transformers keeps them
            size = lambda dt: torch.empty((), dtype=dt).element_size()  # noqa: E731
            kept = sum(h * w * size(dt) for h, w, dt in (theirs["k"], theirs["v"]))
            kept += sum(w * size(dt) for w, dt in theirs.get("side", []))
            assert kept == attn.kv_bytes_per_token, f"{model_type} layer {i}: {kept} B per token"
    # hybridkv keeps one conv column fewer than transformers, and says so
    wide = with_conv_columns(spec, "kernel")
    for (_, a), (_, b) in zip(spec.recurrent_layers(), wide.recurrent_layers(), strict=True):
        for ca, cb in zip(a.components, b.components, strict=True):
            assert ca.shape[:-1] == cb.shape[:-1]
            assert ca.shape[-1] == cb.shape[-1] - (1 if ca.name.startswith("conv") else 0)
    assert dict(spec.dtype_sources), "every read names where its dtypes came from"


def test_the_oracle_can_fail(tmp_path):
    """A reader that kept the conv kernel columns, or the SSM in bf16, would be caught."""
    hf, path = _run_tiny("mamba2", tmp_path)
    spec = load_spec(path, state_dtype="bfloat16")
    assert _expected(with_conv_columns(spec, "kernel").layers[0]) != hf[0]
    assert _expected(load_spec(path).layers[0]) != hf[0]  # kernel-1 columns are not what HF keeps


def _hybrid_or_recurrent_types() -> dict[str, dict]:
    """Every model_type of the installed transformers whose default config declares a recurrent,
    conv or hybrid layer (layer_types / layers_block_type / block_types), or whose modeling keeps
    a recurrent state without declaring it."""
    _quiet()
    out = {}
    own = {"mamba", "falcon_mamba", "mamba2", "rwkv", "xlstm", "recurrent_gemma", "falcon_h1", "bamba", "zamba"}
    own |= {"dory"}  # looped sliding-window attention: no recurrent layer, but per-loop caches
    own |= {"lfm2", "lfm2_moe", "minimax_m2", "jamba"}  # default configs that list no recurrent layer
    for mt in sorted(transformers.CONFIG_MAPPING.keys()):
        try:
            cfg = transformers.CONFIG_MAPPING[mt]()
        except Exception:  # noqa: BLE001 - a config class that needs arguments is not a decoder we read
            continue
        d = cfg.to_dict()
        text = d.get("text_config") if isinstance(d.get("text_config"), dict) else d
        kinds = set()
        for key in ("layer_types", "layers_block_type", "block_types"):
            if isinstance(text.get(key), list):
                kinds |= {str(v) for v in text[key]}
        if mt in own or kinds & {"linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba", "recurrent"}:
            out[mt] = d
    return out


def test_every_hybrid_or_recurrent_model_type_reads_or_says_why():
    if transformers.__version__ != PINNED:
        pytest.skip(f"the model_type list is that of transformers {PINNED}, installed {transformers.__version__}")
    found = _hybrid_or_recurrent_types()
    issue = {"mamba", "falcon_h1", "granitemoehybrid", "bamba", "zamba2", "lfm2", "qwen3_5_text", "kimi_linear"}
    assert issue | {"olmo_hybrid", "falcon_mamba", "qwen3_5", "qwen3_5_moe", "lfm2_moe", "zamba", "rwkv"} <= set(found)
    read, refused = [], []
    for mt, d in found.items():
        try:
            spec = spec_from_hf_config(d, f"{mt}/config.json")
        except SpecError as e:
            msg = str(e)
            assert len(msg.splitlines()) == 1 and repr(mt) in msg or "text_config" in msg, msg
            inner = str((d.get("text_config") or {}).get("model_type", ""))
            if "qwen4_exp_text" in (mt, inner):  # its default config names no QSA indexer: transformers cannot build it
                assert "needs 'indexer_head_dim'" in msg, msg
                continue
            if mt in CASES:  # a reader's family: its default config lacks the layer kinds, and says which key
                assert "needs 'layer_types'" in msg, msg
                continue
            assert mt in NOT_DESCRIBED or inner in NOT_DESCRIBED, f"{mt} refused without a listed reason: {msg}"
            refused.append(mt)
        else:
            assert spec.recurrent_layer_ids or spec.attention_layer_ids
            read.append(mt)
    assert set(CASES) - {"lfm2_moe", "qwen4_exp_text"} <= set(read)
    assert {"xlstm", "zamba", "bailing_hybrid", "recurrent_gemma", "lfm3_vl"} <= set(read)
    assert {"glm5_next", "glm5_next_text"} <= set(read) and not {"qwen4_exp", "qwen4_exp_text"} & set(refused)
    assert {"inkling_mm_model", "inkling2", "inkling2_loop"} <= set(read)


@pytest.mark.parametrize("model_type", ["llama4_hybrid_next", "mamba3"])
def test_a_model_type_added_later_is_one_clear_line(model_type):
    cfg = {"model_type": model_type, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]}
    with pytest.raises(SpecError) as e:
        spec_from_hf_config(cfg)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and f"model_type {model_type!r} is not understood" in msg
    assert "linear_attention" in msg  # it names what the config declares, never guesses a layout
    assert model_type not in READERS


@pytest.mark.parametrize(
    "model_type, hub",
    [
        # the hub's bailing_hybrid config: head_dim is the KDA head dim, no layer_types (layer_group_size)
        ("bailing_hybrid", dict(CASES["bailing_hybrid"], layer_types=None)),
        # Zamba v1 without layers_block_type: transformers derives it from attn_layer_period / offset
        (
            "zamba",
            dict(CASES["zamba"], layers_block_type=None, num_hidden_layers=9, attn_layer_period=3, attn_layer_offset=1),
        ),
        # NX-AI/xLSTM-7b's config.json names embedding_dim and num_blocks only (transformers' class defaults
        # for hidden_size / num_hidden_layers, 4096 / 32, happen to equal them)
        ("xlstm", dict(embedding_dim=4096, num_blocks=32, num_heads=8, qk_dim_factor=0.5, v_dim_factor=1.0)),
        # GLM-5 Next with the hub's linear_attn_config spelling of the KDA fields (transformers copies them)
        (
            "glm5_next_text",
            dict(
                {k: v for k, v in CASES["glm5_next_text"].items() if k not in ("linear_head_dim", "linear_num_heads")},
                linear_attn_config={"num_heads": 4, "head_dim": 8, "short_conv_kernel_size": 3},
            ),
        ),
    ],
)
def test_hub_keys_read_as_transformers_derives_them(model_type, hub, tmp_path):
    _quiet()
    hub = {k: v for k, v in hub.items() if v is not None}
    transformers.CONFIG_MAPPING[model_type](pad_token_id=0, **hub).save_pretrained(tmp_path)
    ours = spec_from_hf_config({"model_type": model_type, **hub})
    assert ours.layers == load_spec(tmp_path).layers  # the hub file and the file transformers writes agree


def test_xlstm_dims_the_cache_and_the_layer_disagree_on_are_refused():
    cfg = {"model_type": "xlstm", "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 2}
    with pytest.raises(SpecError, match="not a multiple of 64") as e:
        spec_from_hf_config(cfg)
    assert len(str(e.value).splitlines()) == 1


@pytest.mark.parametrize("model_type", ["glm5_next_text", "qwen4_exp_text"])
def test_indexed_models_plan_and_a_manager_allocates_them(model_type, tmp_path):
    """The side tensors of the config transformers wrote are paged with K/V: the planner gives them
    segments after V and one request's blocks are exactly its footprint."""
    from hybridkv.blockmgr.manager import HybridBlockManager
    from hybridkv.planner.layout import plan

    _quiet()
    transformers.CONFIG_MAPPING[model_type](pad_token_id=0, dtype="bfloat16", **CASES[model_type]).save_pretrained(
        tmp_path
    )
    spec = load_spec(tmp_path)
    layout = plan(spec, 8 * 2**20)
    assert layout.side_segments > 0
    per_token = layout.segment_bytes // layout.block_size
    for _, attn in spec.attention_layers():
        first, n, _ = layout.side_segment_run(attn)
        assert first == layout.key_segments + layout.value_segments and n * per_token >= attn.side_bytes_per_token
    manager = HybridBlockManager(layout)
    free = manager.num_available_blocks
    manager.allocate("r", 100)
    assert free - manager.num_available_blocks == layout.footprint(100).num_blocks
    fp = layout.footprint(100)
    assert fp.kv_bytes == 100 * spec.kv_bytes_per_token
    assert fp.kv_bytes + fp.state_bytes + fp.waste.total_bytes == fp.allocated_bytes
