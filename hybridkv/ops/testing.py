"""Helpers for testing the ops on small layouts: tiny models, random pool contents, random tables.

Kept beside the ops (like ``torch.testing``) so tests and benchmarks build the same cases. The
expected-state helper reads the layout's rule literally (block ``j`` holds state bytes
``[j * block_bytes, (j + 1) * block_bytes)``, its segments back to back), independently of the
vectorised address arithmetic the reference ops use.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING

import numpy as np

from hybridkv.models.spec import AttentionLayerSpec, ModelSpec, NoCacheLayerSpec, RecurrentLayerSpec, StateComponent
from hybridkv.ops.pools import BlockPools
from hybridkv.planner.layout import NULL_BLOCK, Layout, plan

if TYPE_CHECKING:
    import torch

INTERPRETER_SKIP = (
    "Triton kernels run on CPU only in Triton's interpreter, which takes torch tensors: set TRITON_INTERPRET=1 "
    "with torch installed (the twin of this test runs in the torch lane)"
)


def interpreter_enabled() -> bool:
    """True when Triton kernels can run on CPU here: ``TRITON_INTERPRET=1``, triton importable, and
    torch importable (the interpreter is built on torch tensors; see :data:`INTERPRETER_SKIP`)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    if importlib.util.find_spec("torch") is None:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def small_layout(
    components: tuple[tuple[str, tuple[int, ...], str], ...] = (
        ("ssm", (3, 5, 7), "float32"),
        ("conv", (6, 3), "bfloat16"),
    ),
    pattern: str = "RARRARR",
    kv_heads: int = 2,
    head_dim: int = 8,
    kv_dtype: str = "bfloat16",
    block_size: int = 4,
    num_blocks: int = 24,
    state_block_bytes: int | None = None,
) -> Layout:
    """A tiny hybrid layout: ``pattern`` of ``A`` (attention), ``R`` (recurrent), ``-`` (no cache).

    With attention the blocks hold ``block_size`` tokens (two segments); without, ``state_block_bytes``
    per block (one segment). ``num_blocks`` includes the null block.
    """
    rec = RecurrentLayerSpec("test", tuple(StateComponent(n, s, d) for n, s, d in components))
    attn = AttentionLayerSpec(kv_heads, head_dim, kv_dtype)
    layers = [attn if ch == "A" else rec if ch == "R" else NoCacheLayerSpec() for ch in pattern]
    model = ModelSpec("tiny", tuple(layers))
    probe = plan(model, 1 << 40, block_size=block_size, state_block_bytes=state_block_bytes)
    return plan(model, probe.bytes_per_block * num_blocks, block_size=block_size, state_block_bytes=state_block_bytes)


def fill_random_(pools: BlockPools, seed: int) -> BlockPools:
    """Random bytes in every block but the null block (which stays zero)."""
    rng = np.random.default_rng(seed)
    shape = tuple(int(n) for n in pools.data.shape)
    noise = rng.integers(0, 256, size=(shape[0], shape[1], shape[2] - 1, shape[3]), dtype=np.uint8)
    if pools.framework.value == "paddle":  # Paddle alone
        import paddle

        pools.data[:, :, 1:] = paddle.to_tensor(noise, place=pools.data.place)
        return pools
    import torch

    pools.torch_data[:, :, 1:].copy_(torch.from_numpy(noise))
    return pools


def random_state_table(
    layout: Layout, batch_size: int, seed: int, null_rows: tuple[int, ...] = (), extra_columns: int = 0
) -> np.ndarray:
    """int32 ``[num_state_groups, B, max blocks_per_state + extra_columns]``: distinct random block ids
    (never the null block) for every used entry; rows in ``null_rows`` and unused columns are NULL_BLOCK."""
    rng = np.random.default_rng(seed)
    width = max(layout.blocks_per_state) + extra_columns
    table = np.full((layout.num_state_groups, batch_size, width), NULL_BLOCK, dtype=np.int32)
    needed = sum(layout.blocks_per_state) * batch_size
    if needed > layout.num_blocks - 1:
        raise ValueError(f"the layout has {layout.num_blocks - 1} usable blocks, the table needs {needed}")
    ids = iter(rng.permutation(np.arange(1, layout.num_blocks)).tolist())
    for g, bps in enumerate(layout.blocks_per_state):
        for b in range(batch_size):
            if b not in null_rows:
                table[g, b, :bps] = [next(ids) for _ in range(bps)]
    return table


def expected_state_bytes(pools: BlockPools, group: int, slot: int, blocks: list[int]) -> torch.Tensor:
    """One state's flat bytes read block by block (null blocks as zeros): uint8 ``[state_bytes]``."""
    import torch

    layout = pools.layout
    spec = layout.state_layer(group, slot)[1]
    pieces = []
    for block in blocks[: layout.blocks_per_state[group]]:
        segments = pools.torch_data[slot, :, block].reshape(-1)  # segment 0, then segment 1
        pieces.append(torch.zeros_like(segments) if block == NULL_BLOCK else segments.clone())
    return torch.cat(pieces)[: spec.state_bytes]
