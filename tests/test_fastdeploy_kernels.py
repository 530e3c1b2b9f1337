"""The layer API's Triton kernels against its reference, through the same entry points, on Paddle caches.

Two copies of the same Paddle caches (every byte random, so a read of an unwritten state or a fresh
prompt reading its stored state shows) run the same steps: one through ``backend="naive"`` (numpy,
float64), one through ``backend="triton"`` (one launch per layer per step; Triton's interpreter, which
takes torch tensors, sees the Paddle memory through DLPack views). After every call the outputs must
agree, and after every step each live row's written state must agree in value; those state bytes are
then copied from the reference into the kernel's caches and every byte of every allocation must be
equal: the kernel wrote exactly where the reference did. Awkward sizes (``d_k`` 3, ``d_v`` 5, several
value tiles), float32 and bfloat16 states, chunked prefill, decode, an empty slot, a late join.
Broken variants given to the kernel only (a wrong row offset in ``cu_seqlens_q``, two rows' state sets
swapped) must fail by a wide margin. Torch lane only: the twins on the reference path are
tests/test_fastdeploy_layers.py and tests/test_fastdeploy_gdn_layers.py, which run in both lanes.
"""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import numpy as np
import pytest

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.integrations.fastdeploy import launch
from hybridkv.integrations.fastdeploy import tensors as tensors_
from hybridkv.integrations.fastdeploy.layers import gated_delta_rule, gdn_conv, lightning_attention
from hybridkv.integrations.fastdeploy.state import read_state_bytes, write_state_bytes
from hybridkv.integrations.fastdeploy.worker import StateTables, allocate_caches, attach_worker
from hybridkv.models.presets import gdn_layer, layers_from_pattern
from hybridkv.models.spec import AttentionLayerSpec, ModelSpec, RecurrentLayerSpec, StateComponent
from hybridkv.ops.states import quant_np
from hybridkv.planner.layout import plan

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton's CPU interpreter takes torch tensors: torch lane with TRITON_INTERPRET=1 only (the reference "
    "twins, tests/test_fastdeploy_layers.py and tests/test_fastdeploy_gdn_layers.py, run in both lanes)",
)

STEPS = [{0: 5, 1: 3}, {0: 1, 1: 4, 3: 2}, {0: 1, 1: 1, 3: 1}, {1: 1, 3: 6}]
OWNERS = {0: "a", 1: "b", 3: "c"}
SLOTS = 4
TOLERANCE = 1e-5  # fp32 kernel arithmetic against the float64 reference, both stored in float32: measured <= 4e-7


def _layout(kind: str, dtype: str, num_blocks: int = 40):
    attn = AttentionLayerSpec(1, 8, "bfloat16")
    if kind == "lightning":
        rec = RecurrentLayerSpec("lightning", (StateComponent("kv", (2, 3, 5), dtype),))
        spec = ModelSpec("mini-minimax", layers_from_pattern("RRA", attn, rec))
    else:
        rec = gdn_layer(1, 2, 3, 5, 4, dtype, "bfloat16")
        spec = ModelSpec("mini-qwen3-next", layers_from_pattern("RA", attn, rec))
    probe = plan(spec, 1 << 20, block_size=4)
    return plan(spec, num_blocks * probe.bytes_per_block, block_size=4)


def _caches(layout, rng, framework="paddle", device="cpu"):
    caches = allocate_caches(layout, framework=framework, device=device)
    for segs in caches.segments:
        for t in segs:
            noise = rng.integers(0, 256, tuple(int(d) for d in t.shape), dtype=np.uint8)
            noise[0] = 0
            t[:] = tensors_.to_like(noise, t)
    return caches


def _call(kind, layer_ids, fm, inputs, backend):
    """One step of every recurrent layer; returns the outputs as float64 numpy."""
    outs = []
    for lid in layer_ids:
        if kind == "lightning":
            q, k, v = inputs[lid]
            outs.append(lightning_attention(q, k, v, [0.3 * (lid + 1), 0.05], fm, lid, backend=backend))
        else:
            x, w, g, beta = inputs[lid]
            outs.append(gdn_conv(x, w, fm, lid, backend=backend))
            dim = 3 + 3
            q, k = outs[-1][:, :3].reshape([-1, 1, 3]), outs[-1][:, 3:dim].reshape([-1, 1, 3])
            v = outs[-1][:, dim:].reshape([-1, 2, 5])
            outs.append(gated_delta_rule(q, k, v, g, beta, fm, lid, backend=backend))
    return [tensors_.to_numpy(o).astype(np.float64) for o in outs]


VALUE_BYTES = {"same": 0, "all": 0}  # quantized value bytes the kernel and the reference wrote alike, of all


def run(kind: str, dtype: str = "float32", variant: str = "", steps: list[dict[int, int]] = STEPS,
        framework: str = "paddle", device: str = "cpu") -> float:  # fmt: skip
    """Max difference (outputs and live states, in value) between the kernel and the reference, on
    caches of ``framework`` on ``device`` (tests/test_fastdeploy_gpu.py runs it on CUDA)."""
    VALUE_BYTES.update(same=0, all=0)
    layout = _layout(kind, dtype, 40 if steps is STEPS else 80)
    rng = np.random.default_rng(1)
    seed_state = rng.bit_generator.state
    ref, ker = _caches(layout, rng, framework, device), None
    rng.bit_generator.state = seed_state
    ker = _caches(layout, rng, framework, device)
    manager = HybridBlockManager(layout)
    t_ref, t_ker = (StateTables(layout, SLOTS, framework=framework, device=device) for _ in range(2))
    layer_ids = [i for i, s in enumerate(layout.model.layers) if isinstance(s, RecurrentLayerSpec)]
    total = {r: sum(step.get(s, 0) for step in steps) for s, r in OWNERS.items()}
    like = ref.segments[0][0]
    done, worst = dict.fromkeys(total, 0), 0.0
    for n, step in enumerate(steps):
        for slot in step:
            rid = OWNERS[slot]
            if rid not in manager.requests:
                manager.allocate(rid, total[rid])
                row = [r.tolist() for r in manager.state_table([rid])[:, 0]]
                t_ref.set_row(slot, row, rid)
                t_ker.set_row(slot, row, rid)
        sizes = [step.get(s, 0) for s in range(SLOTS)]
        meta = {"cu_seqlens_q": tensors_.to_like(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32), like),
                "seq_lens_decoder": tensors_.to_like(np.array([done.get(OWNERS.get(s), 0) for s in range(SLOTS)],
                                                              dtype=np.int32), like)}  # fmt: skip
        fm_ref = attach_worker(SimpleNamespace(**meta), ref, t_ref)
        fm_ker = attach_worker(SimpleNamespace(**meta), ker, t_ker)
        if n == 1 and variant == "row-offset":  # row 1 ends one token late (into row 3's), row 3 starts late
            fm_ker.cu_seqlens_q = meta["cu_seqlens_q"] + tensors_.to_like(np.array([0, 0, 1, 1, 0], np.int32), like)
        if n == 1 and variant == "swap":
            t = t_ker.numpy()
            t[:, [0, 1]] = t[:, [1, 0]]
            fm_ker.state_block_tables = tensors_.to_like(t, like)
        num_tokens = sum(sizes)
        inputs = {}
        for lid in layer_ids:
            if kind == "lightning":
                arrays = [rng.standard_normal((num_tokens, 2, d)) * 0.5 for d in (3, 3, 5)]
            else:
                arrays = [rng.standard_normal((num_tokens, 16)), rng.standard_normal((16, 4)) * 0.5,
                          -np.log1p(np.exp(rng.standard_normal((num_tokens, 2)))),
                          1 / (1 + np.exp(-rng.standard_normal((num_tokens, 2))))]  # fmt: skip
            inputs[lid] = [tensors_.to_like(a.astype(np.float32), like) for a in arrays]
        got_ref = _call(kind, layer_ids, fm_ref, inputs, "naive")
        got_ker = _call(kind, layer_ids, fm_ker, inputs, "triton")
        worst = max([worst] + [float(np.abs(a - b).max(initial=0.0)) for a, b in zip(got_ref, got_ker, strict=True)])
        for lid in layer_ids:
            slot_ref, slot_ker = ref.layer_slots[lid], ker.layer_slots[lid]
            spec = layout.model.layers[lid]
            for s in step:
                blocks = [int(b) for b in t_ref.numpy()[slot_ref.group][s] if b >= 0]
                a = read_state_bytes(slot_ref, layout, blocks, spec.state_bytes)
                b = read_state_bytes(slot_ker, layout, blocks, spec.state_bytes)
                for comp, at in spec.component_offsets().items():
                    c = spec.component(comp)
                    if c.dtype.quantized:  # the same stochastic rounding of fp32 / float64 sums: one step apart at most
                        va, vb = (quant_np.decode(x[None, at : at + c.nbytes], c.dtype, c.numel, c.scale_group)
                                  for x in (a, b))  # fmt: skip
                        groups = np.abs(va).reshape(-1, c.scale_group).max(1, keepdims=True)
                        quantum = groups / c.dtype.quant_max if c.dtype.value == "int8" else groups * 2.0**-3
                        excess = np.abs(va - vb).reshape(-1, c.scale_group) - quantum * 1.001
                        worst = max(worst, float(excess.max()))
                        VALUE_BYTES["same"] += int((a[at : at + c.value_bytes] == b[at : at + c.value_bytes]).sum())
                        VALUE_BYTES["all"] += c.value_bytes
                        write_state_bytes(slot_ker, layout, blocks, a)
                        continue
                    va, vb = (_values(x[at : at + c.nbytes], c.dtype.value) for x in (a, b))
                    if c.dtype.value == "float32":
                        worst = max(worst, float(np.abs(va - vb).max()))
                    else:  # rounded to bfloat16 from fp32 and from float64 sums: what exceeds one ulp counts
                        worst = max(worst, float((np.abs(va - vb) - np.abs(va) * 2.0**-7).max()))
                write_state_bytes(slot_ker, layout, blocks, a)
        if not variant:
            for seg_ref, seg_ker in zip(ref.segments, ker.segments, strict=True):
                for x, y in zip(seg_ref, seg_ker, strict=True):
                    assert (tensors_.to_numpy(x) == tensors_.to_numpy(y)).all(), "the kernel wrote outside the states"
        for s, c in step.items():
            done[OWNERS[s]] += c
    return worst


def _values(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return raw.view(np.float32).astype(np.float64)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lightning_kernel_equals_the_reference(dtype):
    assert run("lightning", dtype) < TOLERANCE


def test_lightning_kernel_over_several_value_tiles(monkeypatch):
    monkeypatch.setattr(launch, "MAX_STATE_TILE", 8)  # BK 4: two value columns a program, three tiles
    monkeypatch.setattr(launch, "MIN_DOT", 1)  # the interpreter's tl.dot takes tiles under 16
    assert run("lightning") < TOLERANCE


def test_gdn_kernels_equal_the_reference():
    assert run("gdn") < TOLERANCE


@pytest.mark.parametrize("kind", ["lightning", "gdn"])
@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_quantized_state_kernels_equal_the_reference(kind, dtype):
    """int8 / fp8 values then float32 row scales at unaligned offsets (30 values, scales from byte 30):
    outputs within fp32 error, every written value within one quantization step of the reference's
    (the same stochastic rounding of fp32 and float64 sums), no byte written elsewhere."""
    assert run(kind, dtype) < TOLERANCE
    # the same seeds and salt: the bytes agree but where fp32 and float64 sums straddle a rounding edge
    assert VALUE_BYTES["same"] >= 0.97 * VALUE_BYTES["all"] > 0, VALUE_BYTES


@pytest.mark.parametrize("kind", ["lightning", "gdn"])
@pytest.mark.parametrize("variant", ["row-offset", "swap"])
def test_broken_variants_fail_by_a_wide_margin(kind, variant):
    assert run(kind, variant=variant) > 1e3 * TOLERANCE


# Prefill rows of several chunks of 16 (the last one short, or of one token, or full), prefills continuing
# from their stored state, a late join of one token, decode rows: the lightning kernel's chunked form
# against the token recurrence.
LONG_STEPS = [{0: 37, 1: 2}, {0: 21, 1: 35, 3: 1}, {0: 1, 1: 1, 3: 17}, {0: 16, 1: 32, 3: 1}]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lightning_prefill_in_chunks_equals_the_token_recurrence(monkeypatch, dtype):
    monkeypatch.setattr(launch, "PREFILL_CHUNK", 16)
    assert run("lightning", dtype, steps=LONG_STEPS) < TOLERANCE


# The kernel's source with one chunk-form term broken, loaded as a module of its own and launched
# through the same entry point: each must fail by a wide margin.
CHUNK_BREAKS = {
    "non-causal": ("b_intra = tl.where(b_gap >= 0,", "b_intra = tl.where(b_gap >= -BT,"),
    "full-chunk decay": ("b_s = _powers(b_log, f_c) * b_s", "b_s = _powers(b_log, f_c * 0 + BT) * b_s"),
    "no S0 decay": ("* b_qdecay[:, None]", "* 1.0"),
}


@pytest.mark.parametrize("variant", sorted(CHUNK_BREAKS))
def test_broken_chunk_forms_fail_by_a_wide_margin(monkeypatch, tmp_path, variant):
    import importlib.util
    import inspect

    from hybridkv.integrations.fastdeploy import kernels

    old, new = CHUNK_BREAKS[variant]
    source = inspect.getsource(kernels)
    assert source.count(old) == 1
    path = tmp_path / f"broken_{variant.replace(' ', '_').replace('-', '_')}.py"
    path.write_text(source.replace(old, new))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(kernels, "lightning_kernel", module.lightning_kernel)
    monkeypatch.setattr(launch, "PREFILL_CHUNK", 16)
    assert run("lightning", variant="chunk", steps=LONG_STEPS) > 1e3 * TOLERANCE
