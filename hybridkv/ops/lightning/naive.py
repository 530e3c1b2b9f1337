"""Lightning attention (MiniMax), the reference: decay slopes, the token recurrence, the block-wise prefill.

The math follows ``docs/models.md``. Per head ``h`` with slope ``s_h`` and
``lambda_h = exp(-s_h)``, a state ``S`` of shape ``[d_k, d_v]``:

- decode (one token): ``S <- lambda_h * S + k^T v``; ``o = q S`` (the output reads the updated state);
- block prefill (block length ``b``, the last block may be shorter and uses its own ``b``):
  ``O = [(Q K^T) * M] V + (Lambda Q) S`` with ``M_ij = lambda^(i-j)`` (``i >= j``) and
  ``Lambda = diag(lambda^1 .. lambda^b)``; then ``S <- lambda^b S + (lambda^b Lambda^-1 K)^T V``.

Everything here works on contiguous torch tensors (any float dtype; pass float64 for an oracle) and
computes in ``compute_dtype`` (default: float64 for float64 inputs, else float32). No SiLU, gate or
normalisation: those are the model's, around the recurrence. Decay tables are built in float64.
"""

from __future__ import annotations

import torch


def lightning_slopes(
    num_heads: int, layer_idx: int, num_layers: int, rule: str = "minimax", dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """Per-head decay slopes ``s_h`` ``[num_heads]`` of decoder layer ``layer_idx`` (0-based, counting every
    layer, softmax layers included) of ``num_layers``.

    ``s_h = 2^(-8h/H)`` for ``h = 1..H`` times the layer factor: ``rule="minimax"`` (MiniMax's model code and
    vLLM) ``1 - l/(L-1) + 1e-5`` (``1 + 1e-5`` when ``L = 1``); ``rule="hf"`` (HuggingFace transformers)
    ``1 - l/(L-1+1e-5) + 1e-5``. Raises ``ValueError`` on an unknown rule or out-of-range indices.
    """
    if num_heads < 1 or not 0 <= layer_idx < num_layers:
        raise ValueError(
            f"need num_heads >= 1 and 0 <= layer_idx < num_layers, got {num_heads}, {layer_idx}, {num_layers}"
        )
    if rule == "minimax":
        factor = 1.0 + 1e-5 if num_layers == 1 else 1.0 - layer_idx / (num_layers - 1) + 1e-5
    elif rule == "hf":
        factor = 1.0 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5
    else:
        raise ValueError(f"slope rule must be 'minimax' or 'hf', got {rule!r}")
    h = torch.arange(1, num_heads + 1, dtype=torch.float64)
    return (torch.exp2(-8.0 * h / num_heads) * factor).to(dtype)


def _compute_dtype(x: torch.Tensor, compute_dtype: torch.dtype | None) -> torch.dtype:
    if compute_dtype is not None:
        return compute_dtype
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def lightning_decode_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    slopes: torch.Tensor,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One token per row: ``state`` ``[B, H, d_k, d_v]`` is updated **in place**; returns ``o`` ``[B, H, d_v]``.

    ``q``, ``k``: ``[B, H, d_k]``; ``v``: ``[B, H, d_v]``; ``slopes``: ``[H]``. ``o`` has ``v``'s dtype.
    """
    cd = _compute_dtype(state, compute_dtype)
    lam = torch.exp(-slopes.to(device=state.device, dtype=torch.float64)).to(cd)
    s = lam[None, :, None, None] * state.to(cd) + k.to(cd)[..., :, None] * v.to(cd)[..., None, :]
    o = torch.einsum("bhk,bhkv->bhv", q.to(cd), s)
    state.copy_(s)
    return o.to(v.dtype)


def lightning_recurrent_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token over one sequence: ``q``, ``k`` ``[T, H, d_k]``, ``v`` ``[T, H, d_v]``.

    Returns ``(o [T, H, d_v], final state [H, d_k, d_v])`` (new tensors; ``initial_state`` is not modified,
    None = zeros). The plainest statement of the recurrence: the oracle of the block-wise form.
    """
    cd = _compute_dtype(v, compute_dtype)
    h, dk, dv = q.shape[1], q.shape[2], v.shape[2]
    s = torch.zeros(1, h, dk, dv, dtype=cd, device=v.device)
    if initial_state is not None:
        s.copy_(initial_state.to(cd)[None])
    outs = [lightning_decode_naive(q[t][None], k[t][None], v[t][None], s, slopes, cd)[0] for t in range(q.shape[0])]
    o = torch.stack(outs) if outs else v.new_zeros(0, h, dv)
    return o.to(v.dtype), s[0]


def lightning_prefill_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    block_size: int = 64,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise (Lightning Attention-2) prefill of one sequence, same contract as :func:`lightning_recurrent_naive`.

    Blocks of ``block_size`` tokens; the last block, when shorter, uses its own length everywhere.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    cd = _compute_dtype(v, compute_dtype)
    t_len, h, dk, dv = q.shape[0], q.shape[1], q.shape[2], v.shape[2]
    s = torch.zeros(h, dk, dv, dtype=cd, device=v.device)
    if initial_state is not None:
        s.copy_(initial_state.to(cd))
    log_lam = -slopes.to(device=v.device, dtype=torch.float64)  # [H]
    o = torch.empty(t_len, h, dv, dtype=cd, device=v.device)
    qc, kc, vc = (x.to(cd).transpose(0, 1) for x in (q, k, v))  # [H, T, d]
    for start in range(0, t_len, block_size):
        b = min(block_size, t_len - start)
        qb, kb, vb = qc[:, start : start + b], kc[:, start : start + b], vc[:, start : start + b]
        i = torch.arange(b, device=v.device, dtype=torch.float64)
        diff = i[:, None] - i[None, :]  # i - j
        mask = torch.where(diff >= 0, torch.exp(log_lam[:, None, None] * diff.clamp(min=0)), 0.0).to(cd)  # [H, b, b]
        lam_pow = torch.exp(log_lam[:, None] * (i[None, :] + 1)).to(cd)  # Lambda: lambda^1..lambda^b, [H, b]
        lam_b = torch.exp(log_lam * b).to(cd)  # lambda^b, [H]
        intra = ((qb @ kb.transpose(1, 2)) * mask) @ vb
        inter = (lam_pow[..., None] * qb) @ s
        o[start : start + b] = (intra + inter).transpose(0, 1)
        k_decay = torch.exp(log_lam[:, None] * (b - 1 - i)[None, :]).to(cd)  # lambda^b * Lambda^-1
        s = lam_b[:, None, None] * s + (k_decay[..., None] * kb).transpose(1, 2) @ vb
    return o.to(v.dtype), s


def lightning_prefill_varlen_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    states: torch.Tensor,
    has_initial_state: torch.Tensor,
    slopes: torch.Tensor,
    block_size: int = 64,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Block-wise prefill of ``N`` packed sequences; ``states`` ``[N, H, d_k, d_v]`` updated **in place**.

    ``q``, ``k`` ``[T, H, d_k]``, ``v`` ``[T, H, d_v]`` packed by ``cu_seqlens`` (int ``[N + 1]``);
    ``has_initial_state`` bool ``[N]``: False starts from zeros (whatever ``states`` held). Rows of
    length 0 keep their state. Returns ``o`` ``[T, H, d_v]``.
    """
    o = torch.zeros_like(v)
    cu = [int(c) for c in cu_seqlens.tolist()]
    init = [bool(x) for x in has_initial_state.tolist()]
    for n in range(len(cu) - 1):
        a, b = cu[n], cu[n + 1]
        if b == a:
            continue
        s0 = states[n] if init[n] else None
        o[a:b], s = lightning_prefill_naive(q[a:b], k[a:b], v[a:b], slopes, s0, block_size, compute_dtype)
        states[n].copy_(s)
    return o


def decay_factors(slopes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``exp(-s_h)`` computed in float64, returned in ``dtype`` (float32 or wider: bf16 rounds it to 1)."""
    if dtype in (torch.bfloat16, torch.float16):
        raise ValueError("decay factors must be float32 or wider (docs/models.md: bf16 rounds exp(-s) to 1.0)")
    return torch.exp(-slopes.to(torch.float64)).to(dtype)


__all__ = [
    "decay_factors",
    "lightning_decode_naive",
    "lightning_prefill_naive",
    "lightning_prefill_varlen_naive",
    "lightning_recurrent_naive",
    "lightning_slopes",
]
