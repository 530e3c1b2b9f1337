"""``hybridkv simulate --engine vllm`` and ``--compare engine=hybridkv,vllm`` (issue 29): the vLLM
engine's fixed policies, vLLM's block-size rule, and the one-switch-per-column comparison.
(``tests/test_vllm_scheduler.py`` checks the engine against vLLM's real scheduler step by step.)"""

import pytest

from hybridkv.cli import main
from hybridkv.errors import LayoutError
from hybridkv.models.presets import preset
from hybridkv.models.spec import DType, ModelSpec, RecurrentLayerSpec, StateComponent
from hybridkv.planner.layout import vllm_block_size
from hybridkv.sim.compare import expand
from hybridkv.sim.config import SimConfig, build
from hybridkv.sim.engines import VLLM_LABEL, VLLM_POLICIES, engine_config
from hybridkv.sim.workload import SyntheticConfig, synthetic

SMALL_FLAGS = ["--requests", "20", "--prompt-median", "2000", "--output-median", "32", "--gpu-memory", "2GiB"]


def test_vllm_block_size_rule():
    """vLLM 0.33's _align_hybrid_block_size: one state per attention page, in multiples of the
    backend's 16 tokens; with prefix caching, of lcm(16, the layers' checkpoint alignment)."""
    qwen = preset("qwen3-next-80b-a3b", "bfloat16", 2)  # 536 KiB state, 1 KiB of K+V per token and layer
    assert vllm_block_size(qwen) == 544
    assert vllm_block_size(qwen, prefix_caching=True, checkpoint_alignment=64) == 576  # FlashInfer GDN on Hopper
    assert vllm_block_size(qwen, prefix_caching=False, checkpoint_alignment=64) == 544
    assert vllm_block_size(preset("minimax-m1", "bfloat16", 8)) == 512
    assert vllm_block_size(preset("minimax-m1", "float32", 8)) == 1024
    rwkv_like = ModelSpec("state only", (RecurrentLayerSpec("gla", (StateComponent("kv", (2, 8, 4), DType.FLOAT32),)),))
    with pytest.raises(LayoutError, match="no attention"):
        vllm_block_size(rwkv_like)


def test_vllm_engine_fixes_vllm_policies_and_keeps_the_rest():
    base = SimConfig(model="qwen3-next-80b-a3b", tp=2, gpu_memory="4GiB", max_num_seqs=64, engine="vllm", prefix="none")
    cfg = engine_config(base)
    assert {k: getattr(cfg, k) for k in VLLM_POLICIES} == VLLM_POLICIES
    assert (cfg.state_dtype, cfg.block_size, cfg.max_num_seqs, cfg.gpu_memory) == ("bfloat16", 544, 64, "4GiB")
    assert cfg.label.startswith(VLLM_LABEL)
    assert engine_config(base.with_changes(state_dtype="float32")).block_size == 1056  # told otherwise: kept
    built = build(base)
    assert built.layout.kind.value == "padded" and built.layout.block_size == 544
    assert built.manager.host_pool is None and built.manager.watermark_blocks == 0
    assert built.manager.prefix_cache is None
    assert built.scheduler.config.admission.value == "full_prompt"
    # the hybridkv engine: as it is, its kernels' export grid resolved (MiniMax's lightning prefill
    # exports at any token, hybridkv's GDN kernel none; 0 is kept: a kernel that cannot)
    assert engine_config(SimConfig()) == SimConfig(checkpoint_export=1)
    assert engine_config(SimConfig(model="qwen3-next-80b-a3b", tp=2)).checkpoint_export == 0
    assert engine_config(SimConfig(checkpoint_export=0)) == SimConfig(checkpoint_export=0)
    assert build(SimConfig(gpu_memory="4GiB")).manager.prefix_cache.config.export_alignment == 1
    # prefix caching on: vLLM's mode align (vllm_align + LRU) at its caching block size, with
    # FlashInfer GDN's in-chunk checkpoint export; MiniMax's lightning layers export none
    cached = build(base.with_changes(prefix="flop_aware"))
    config = cached.manager.prefix_cache.config
    assert (config.checkpoint.value, config.eviction.value, config.export_alignment) == ("vllm_align", "lru", 64)
    assert cached.layout.block_size == 576
    minimax = engine_config(SimConfig(model="minimax-m1", tp=8, gpu_memory="4GiB", engine="vllm"))
    assert (minimax.checkpoint, minimax.checkpoint_export, minimax.block_size) == ("vllm_align", 0, 512)
    with pytest.raises(ValueError, match="engine"):
        SimConfig(engine="sglang")


def test_compare_engine_is_one_switch_per_column():
    base = SimConfig(model="qwen3-next-80b-a3b", tp=2, gpu_memory="4GiB")
    cols = expand(base, ["engine=hybridkv,vllm"])
    assert cols[0].engine == "vllm" and cols[0].label == VLLM_LABEL
    assert [c.label.split(" (")[0] for c in cols[1:]] == [
        "+ admission reserved",
        "+ layout paged",
        "+ state float32",  # Qwen3-Next's preset keeps the SSM state in fp32; vLLM the model's bf16
        "+ preemption auto host 256GiB watermark 0.01",
        "+ prefix lru/branch_spaced",
    ]
    fields = [k for k in SimConfig.__dataclass_fields__ if k != "label"]
    last = cols[-1]
    assert {k: getattr(last, k) for k in fields} == {k: getattr(base, k) for k in fields}
    effective = [engine_config(c) for c in cols]
    for a, b in zip(effective[1:], effective[2:], strict=False):  # each column switches one policy
        changed = {k for k in fields if getattr(a, k) != getattr(b, k)}
        assert changed and changed <= {"layout", "block_size", "state_dtype", "preemption", "host_memory",
                                       "watermark", "prefix", "checkpoint", "checkpoint_export", "speculative"}
    # other keys still multiply: two memories, a ladder each
    assert len(expand(base, ["engine=hybridkv,vllm", "gpu-memory=4GiB,8GiB"])) == 2 * len(cols)
    with pytest.raises(ValueError, match="not one of"):
        expand(base, ["engine=vllm,sglang"])


def test_cli_engine_vllm_and_the_engine_comparison(tmp_path, capsys):
    assert main(["simulate", *SMALL_FLAGS, "--engine", "vllm", "--out", str(tmp_path / "a"), "--no-progress"]) == 0
    assert VLLM_LABEL in capsys.readouterr().out
    out = tmp_path / "b"
    argv = ["simulate", *SMALL_FLAGS, "--compare", "engine=hybridkv,vllm", "--workers", "1", "--out", str(out)]
    assert main([*argv, "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert VLLM_LABEL in printed and "+ admission reserved" in printed and "scheduled tokens" in printed
    md = (out / "report.md").read_text()
    assert "| engine | vllm | hybridkv |" in md and "| admission | full_prompt | reserved |" in md


def test_vllm_engine_runs_a_workload_through_the_simulator():
    from hybridkv.sim.simulator import simulate

    w = synthetic(SyntheticConfig(num_requests=12, prompt_median=1500, output_median=16, seed=1))
    raw = simulate(SimConfig(gpu_memory="2GiB", engine="vllm", integrity_every=5), w)
    assert raw["config"]["engine"] == "vllm" and raw["config"]["admission"] == "full_prompt"
    assert raw["layout"]["kind"] == "padded" and raw["layout"]["block_size"] == 512
    assert all(r["status"] == "finished" for r in raw["requests"])
