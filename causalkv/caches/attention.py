"""Attention over a cache view, one K/V segment at a time (log-sum-exp merge).

For a view whose K/V are stored as several segments (the QVG packed cache dequantizes one
packed segment at a time), `attend` never holds the whole window densely. Per segment and
per block of queries it computes the block's attention output over that segment and its
log-sum-exp, then merges it into the running output with the online-softmax recurrence.
Its transient memory is one dequantized segment plus one query block's partial output,
which `AttendStats` reports.

On the CPU the per-segment step is PyTorch's fused flash-attention kernel, which returns the
log-sum-exp next to the output and never materializes the ``[n, s]`` scores; elsewhere a
plain fp32 computation over small query blocks stands in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from causalkv.caches.spec import CausalAttentionKVView

__all__ = ["AttendStats", "attend", "attend_dense"]

#: queries per block on the CPU flash path / on the fallback path
CPU_QUERY_BLOCK = 512
FALLBACK_QUERY_BLOCK = 64


@dataclass
class AttendStats:
    """What one `attend` call held besides its inputs and output.

    Attributes:
        segments: segments visited.
        peak_segment_nbytes: the largest segment's K+V (dequantized, for a packed segment).
        peak_transient_nbytes: the largest sum of live temporaries at any point: the current
            segment's K+V plus one query block's partial output, log-sum-exp and merge weights.
    """

    segments: int = 0
    peak_segment_nbytes: int = 0
    peak_transient_nbytes: int = 0


def attend_dense(
    query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None
) -> torch.Tensor:
    """Softmax attention of ``query`` ``[B, n, h, D]`` over ``k``/``v`` ``[B, s, h, D]`` (no mask)."""
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale
    )
    return out.transpose(1, 2)


def _partial(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, fused: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, h, m, D], lse [B, h, m] fp32)`` of queries ``q [B, h, m, D]`` over ``k, v``.

    ``fused``: PyTorch's CPU flash kernel; otherwise fp32 scores for the block (small blocks).
    """
    if fused:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=scale)
        return out, lse
    s = (q @ k.transpose(-1, -2)).float() * scale  # [B, h, m, s]
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).to(v.dtype)
    return p @ v, lse


def attend(
    query: torch.Tensor,
    view: CausalAttentionKVView,
    *,
    scale: float | None = None,
    stats: AttendStats | None = None,
) -> torch.Tensor:
    """Softmax attention of ``query`` ``[B, n, h, D]`` over every visible token of ``view``.

    Equals ``attend_dense(query, view.k, view.v)`` up to floating-point rounding. A view
    whose K/V are already materialized (every dense cache view) goes straight to SDPA;
    otherwise ``view.iter_segments()`` is walked and each segment's partial result merged
    with the log-sum-exp recurrence in float32, so a packed view is dequantized one segment
    at a time and never materialized whole. Pass ``stats`` to learn the transient memory.

    Returns ``[B, n, h, D]`` in ``query.dtype``.
    """
    if view.is_materialized:
        return attend_dense(query, view.k, view.v, scale=scale)
    b, n, h, d = query.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q = query.transpose(1, 2)  # [B, h, n, D], a view
    fused = query.device.type == "cpu"
    block = CPU_QUERY_BLOCK if fused else FALLBACK_QUERY_BLOCK
    acc = torch.zeros((b, h, n, d), dtype=torch.float32, device=query.device)
    lse_run = torch.full((b, h, n), -math.inf, dtype=torch.float32, device=query.device)
    st = stats if stats is not None else AttendStats()
    for k_seg, v_seg in view.iter_segments():
        k, v = k_seg.transpose(1, 2), v_seg.transpose(1, 2)  # [B, h, s, D] views
        seg_bytes = k_seg.nbytes + v_seg.nbytes
        st.segments += 1
        st.peak_segment_nbytes = max(st.peak_segment_nbytes, seg_bytes)
        for q0 in range(0, n, block):
            q1 = min(n, q0 + block)
            out, lse = _partial(q[:, :, q0:q1], k.to(q.dtype), v.to(q.dtype), scale, fused=fused)
            run = lse_run[:, :, q0:q1]
            m = torch.maximum(run, lse)
            w_old, w_new = torch.exp(run - m), torch.exp(lse - m)
            total = w_old + w_new
            a = acc[:, :, q0:q1]
            a.mul_((w_old / total).unsqueeze(-1))
            a.add_(out.float() * (w_new / total).unsqueeze(-1))
            run.copy_(m + torch.log(total))
            block_bytes = out.nbytes * (1 + 4 // out.element_size()) + 5 * lse.nbytes
            st.peak_transient_nbytes = max(st.peak_transient_nbytes, seg_bytes + block_bytes)
            del out, lse, m, w_old, w_new, total
        del k, v, k_seg, v_seg
    if st.segments == 0:
        raise ValueError("attend: the view has no visible tokens; write a chunk first")
    return acc.transpose(1, 2).to(query.dtype)
