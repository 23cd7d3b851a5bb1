"""Attention over a cache view, one K/V segment at a time (online-softmax merge).

For a view whose K/V are stored as several segments (the QVG packed cache dequantizes one
packed segment at a time), `attend` never holds the whole window densely: its transient
memory is one segment's K/V plus the ``[B, h, n, s]`` scores of that segment.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from causalkv.caches.spec import CausalAttentionKVView

__all__ = ["attend", "attend_dense"]


def attend_dense(
    query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None
) -> torch.Tensor:
    """Softmax attention of ``query`` ``[B, n, h, D]`` over ``k``/``v`` ``[B, s, h, D]`` (no mask)."""
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale
    )
    return out.transpose(1, 2)


def attend(
    query: torch.Tensor, view: CausalAttentionKVView, *, scale: float | None = None
) -> torch.Tensor:
    """Softmax attention of ``query`` ``[B, n, h, D]`` over every visible token of ``view``.

    Equals ``attend_dense(query, view.k, view.v)`` up to floating-point rounding, but walks
    ``view.iter_segments()`` and merges partial results with the online-softmax recurrence
    (running max ``m``, normalizer ``l``, accumulator ``acc`` in float32), so a packed view is
    dequantized one segment at a time and never materialized whole.

    Returns ``[B, n, h, D]`` in ``query.dtype``.
    """
    if view.is_materialized:
        return attend_dense(query, view.k, view.v, scale=scale)
    segments = view.iter_segments()
    first = next(segments, None)
    if first is None:
        raise ValueError("attend: the view has no visible tokens; write a chunk first")
    second = next(segments, None)
    if second is None:
        return attend_dense(query, first[0], first[1], scale=scale)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    q = query.transpose(1, 2).float() * scale  # [B, h, n, D]
    m = denom = acc = None
    for k_seg, v_seg in _chain(first, second, segments):
        s = q @ k_seg.transpose(1, 2).float().transpose(-1, -2)  # [B, h, n, s]
        m_seg = s.amax(dim=-1, keepdim=True)
        if m is None:
            m_new = m_seg
            p = torch.exp(s - m_new)
            denom = p.sum(dim=-1, keepdim=True)
            acc = p @ v_seg.transpose(1, 2).float()
        else:
            m_new = torch.maximum(m, m_seg)
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new)
            denom = denom * alpha + p.sum(dim=-1, keepdim=True)
            acc = acc * alpha + p @ v_seg.transpose(1, 2).float()
        m = m_new
        del s, p
    out = acc / denom
    return out.transpose(1, 2).to(query.dtype)


def _chain(first, second, rest):
    yield first
    yield second
    yield from rest
