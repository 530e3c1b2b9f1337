"""lightning_attention against transformers' own MiniMax lightning layer, same weights (torch lane).

transformers' ``MiniMaxLightningAttention`` computes each sequence alone, block-wise, from zero. A
FastDeploy-style layer built from the same module's weights (``qkv_proj`` + activation, ``norm``,
sigmoid ``output_gate``, ``out_proj``) calls :func:`lightning_attention` for the recurrence, over a
flat batch of two requests in two steps (prompts, then a decode token and a prefill chunk that
continue from the paged state). Every output equals transformers' within float32 noise (3e-7). And
:func:`gated_delta_rule` over a flat batch against transformers' chunked Qwen3-Next gated delta rule
over each whole sequence (1.2e-7).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.integrations.fastdeploy.layers import lightning_attention
from hybridkv.integrations.fastdeploy.worker import StateTables, allocate_caches, attach_worker
from hybridkv.models.presets import layers_from_pattern, lightning_layer
from hybridkv.models.spec import AttentionLayerSpec, ModelSpec
from hybridkv.planner.layout import plan
from tests.hf_tiny_configs import CASES

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

STEPS = [{0: 7, 1: 5}, {0: 1, 1: 3}]  # slot -> tokens: prompts, then a decode token and a chunk
TOLERANCE = 1e-5  # float32 block-wise (transformers) against float64 token by token: measured 3e-7


def test_lightning_attention_equals_transformers_minimax_layer():
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    torch.manual_seed(0)
    cfg = transformers.CONFIG_MAPPING["minimax"](pad_token_id=0, **CASES["minimax"])
    layer = MiniMaxLightningAttention(cfg, layer_idx=0).eval()
    heads, dim = layer.num_attention_heads, layer.head_dim
    spec = ModelSpec("hf-minimax-mini", layers_from_pattern("RA", AttentionLayerSpec(1, 8, "bfloat16"),
                                                            lightning_layer(heads, dim, "float32")))  # fmt: skip
    probe = plan(spec, 1 << 22, block_size=4)
    layout = plan(spec, 80 * probe.bytes_per_block, block_size=4)
    manager, caches = HybridBlockManager(layout), allocate_caches(layout, framework="torch")
    tables = StateTables(layout, 2, framework="torch")
    total = {s: sum(step[s] for step in STEPS) for s in (0, 1)}
    hidden = {s: torch.randn(total[s], cfg.hidden_size) for s in (0, 1)}
    for s in (0, 1):
        manager.allocate(f"r{s}", total[s])
        tables.set_row(s, [row.tolist() for row in manager.state_table([f"r{s}"])[:, 0]], f"r{s}")
    with torch.no_grad():
        want = {s: layer(hidden[s][None], None, None)[0][0] for s in (0, 1)}  # each sequence alone
        done, worst = {0: 0, 1: 0}, 0.0
        for step in STEPS:
            fm = attach_worker(SimpleNamespace(), caches, tables)
            fm.cu_seqlens_q = np.array([0, step[0], step[0] + step[1]])
            fm.seq_lens_decoder = np.array([done[0], done[1]])
            h = torch.cat([hidden[s][done[s] : done[s] + step[s]] for s in (0, 1)])
            qkv = layer.act_fn(layer.qkv_proj(h)).reshape(len(h), heads, 3 * dim)
            q, k, v = torch.split(qkv, dim, dim=2)
            o = lightning_attention(q, k, v, layer.slope_rate.reshape(-1).numpy(), fm, 0)
            o = torch.sigmoid(layer.output_gate(h)) * layer.norm(o.reshape(len(h), heads * dim))
            got = layer.out_proj(o)
            at = 0
            for s in (0, 1):
                worst = max(worst, float((got[at : at + step[s]] - want[s][done[s] : done[s] + step[s]]).abs().max()))
                at += step[s]
                done[s] += step[s]
    assert worst < TOLERANCE, worst


def test_gated_delta_rule_equals_transformers_chunked_gated_delta_rule():
    """gated_delta_rule over a flat batch (prompts, then a chunk and a decode token continuing from the
    paged state) against transformers' Qwen3-Next chunked form over each whole sequence."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    from hybridkv.integrations.fastdeploy.layers import gated_delta_rule
    from hybridkv.models.presets import gdn_layer

    hk, hv, dk, dv, steps = 2, 4, 8, 16, [{0: 9, 1: 6}, {0: 1, 1: 5}]
    rec = gdn_layer(hk, hv, dk, dv, 4, "float32", "float32")
    spec = ModelSpec("hf-qwen3-next-mini", layers_from_pattern("RA", AttentionLayerSpec(1, 8, "bfloat16"), rec))
    probe = plan(spec, 1 << 22, block_size=4)
    layout = plan(spec, 80 * probe.bytes_per_block, block_size=4)
    manager, caches = HybridBlockManager(layout), allocate_caches(layout, framework="torch")
    tables = StateTables(layout, 2, framework="torch")
    gen = torch.Generator().manual_seed(0)
    total = {s: sum(step[s] for step in steps) for s in (0, 1)}
    seq = {s: (torch.randn(total[s], hk, dk, generator=gen), torch.randn(total[s], hk, dk, generator=gen),
               torch.randn(total[s], hv, dv, generator=gen), -torch.rand(total[s], hv, generator=gen),
               torch.rand(total[s], hv, generator=gen)) for s in (0, 1)}  # fmt: skip
    for s in (0, 1):
        manager.allocate(f"r{s}", total[s])
        tables.set_row(s, [row.tolist() for row in manager.state_table([f"r{s}"])[:, 0]], f"r{s}")
    want = {}
    for s, (q, k, v, g, b) in seq.items():
        rep = hv // hk
        out, _ = torch_chunk_gated_delta_rule(q.repeat_interleave(rep, 1)[None], k.repeat_interleave(rep, 1)[None],
                                              v[None], g[None], b[None], use_qk_l2norm_in_kernel=True)  # fmt: skip
        want[s] = out[0]
    done, worst = {0: 0, 1: 0}, 0.0
    for step in steps:
        fm = attach_worker(SimpleNamespace(), caches, tables)
        fm.cu_seqlens_q = np.array([0, step[0], step[0] + step[1]])
        fm.seq_lens_decoder = np.array([done[0], done[1]])
        args = [torch.cat([seq[s][i][done[s] : done[s] + step[s]] for s in (0, 1)]) for i in range(5)]
        got = gated_delta_rule(*args, fm, 0)
        at = 0
        for s in (0, 1):
            worst = max(worst, float((got[at : at + step[s]] - want[s][done[s] : done[s] + step[s]]).abs().max()))
            at += step[s]
            done[s] += step[s]
    assert worst < TOLERANCE, worst
