"""Attention over a cache view, one K/V segment at a time (log-sum-exp merge).

For a view whose K/V are stored as several segments (the QVG packed cache), `attend` never
holds the whole window densely. Per segment it computes the queries' attention output over
that segment and its log-sum-exp, and merges it into a running float32 output with the
online-softmax recurrence. Two paths:

- **Decode path** (the CPU, or ``fused=False``): ``view.iter_segments()`` dequantizes one
  packed segment at a time; per block of queries the segment step is PyTorch's fused
  attention that returns the log-sum-exp (the CPU flash kernel; CUDA's flash or
  memory-efficient kernel; a plain fp32 computation elsewhere). Transient memory: one
  dequantized segment plus one query block's partial output.
- **Fused path** (CUDA by default, ``fused=True`` anywhere the Triton kernel runs):
  ``view.iter_stored_segments()`` yields packed records as stored (any codec's
  `causalkv.caches.codecs.base.PackedRecord`); a record type registered with an attention
  kernel (PRQ's `causalkv.caches.codecs.prq.attention.packed_attention`) is attended directly,
  decoding K/V tiles in registers and merging into the running output in its epilogue: a
  packed segment costs no temporary at all. Any other record is decoded, then attended.
  Dense segments (the current chunk, recent chunks kept bf16) take the fused-attention step
  above over query blocks of `GPU_QUERY_BLOCK`.

`AttendStats` reports which path each segment took, the transient bytes, and why packed
segments were decoded before attention (``decode_reasons``). The caches print nothing: the
host that called `attend` reads the reasons and says them in its log, once.

`forced_route` is the hosts' one test override: while it holds, a host's route over packed
segments is engaged (or declined) on any device with the path it names (`ForcedRoute`).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType

import torch
import torch.nn.functional as F

from causalkv.caches.codecs.base import decode_record, record_kind
from causalkv.caches.codecs.prq import triton_impl
from causalkv.caches.spec import CausalAttentionKVView
from causalkv.errors import CausalKVError

__all__ = [
    "NO_TRITON",
    "AttendError",
    "AttendStats",
    "ForcedRoute",
    "attend",
    "attend_dense",
    "forced_route",
    "route_override",
]

#: queries per block of a dense segment's step on CUDA, and on the fused path on any device
#: (so the fused path's `AttendStats` measured on the CPU are the CUDA ones)
GPU_QUERY_BLOCK = 2048


class AttendError(CausalKVError, ValueError):
    """`attend` was asked for something it cannot do (an empty view, an unavailable path)."""


@dataclass
class AttendStats:
    """What one `attend` call did and held besides its inputs and output.

    Attributes:
        segments: segments visited.
        fused_segments: packed segments the kernel attended in place (never decoded).
        decoded_segments: packed segments the fused path had to decode first (a layout the
            kernel does not take, e.g. a head_dim that is not a power of two).
        peak_segment_nbytes: the largest segment's K+V as attended: dense bytes (dequantized,
            for a packed segment on the decode path), or its stored packed bytes when the
            kernel reads it in place.
        peak_transient_nbytes: the largest sum of live temporaries at any point. Decode path:
            the current segment's K+V plus one query block's partial output, log-sum-exp and
            merge weights. Fused path: for a packed segment the kernel's workspace (0 for one
            k-means stage); for a dense one (views of the cache, not counted) any dtype copy
            plus one query block's partial output, log-sum-exp and merge weights (the output
            merged with ``addcmul_``, no fp32 copy of it).
        accumulator_nbytes: the running float32 output and log-sum-exp, held for the whole
            call (the returned output is a cast of it).
        decode_reasons: why packed segments were decoded before attention instead of read in
            place by the kernel, each reason once, in the order met: triton does not import (the
            default path on CUDA falls back to decoding), or a packed segment the kernel does not
            take (its reason). Empty when nothing was decoded for lack of the kernel. `attend`
            logs nothing; its caller reports these.
    """

    segments: int = 0
    fused_segments: int = 0
    decoded_segments: int = 0
    peak_segment_nbytes: int = 0
    peak_transient_nbytes: int = 0
    accumulator_nbytes: int = 0
    decode_reasons: list[str] = field(default_factory=list)

    def note(self, reason: str) -> None:
        """Record ``reason`` in `decode_reasons` (once)."""
        if reason not in self.decode_reasons:
            self.decode_reasons.append(reason)

    def unreported(self) -> list[str]:
        """The `decode_reasons` not returned by this method before in this process: what a host
        logs, so that each reason is said once per process (the caches print nothing)."""
        new = [r for r in self.decode_reasons if r not in _REPORTED]
        _REPORTED.update(new)
        return new


#: the decode reasons `AttendStats.unreported` has returned in this process
_REPORTED: set[str] = set()


def attend_dense(
    query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None
) -> torch.Tensor:
    """Softmax attention of ``query`` ``[B, n, h, D]`` over ``k``/``v`` ``[B, s, h, D]`` (no mask)."""
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale
    )
    return out.transpose(1, 2)


# ---------------------------------------------------------------------------------------------
# One segment step: (out, lse) of a query block over dense K/V
# ---------------------------------------------------------------------------------------------
def cuda_flash_supported(dtype: torch.dtype, head_dim: int, capability: tuple[int, int]) -> bool:
    """Whether PyTorch's CUDA flash kernel takes ``dtype`` queries of ``head_dim`` on a GPU of
    compute ``capability`` (else the memory-efficient kernel runs)."""
    return (dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0
            and head_dim <= 256 and capability >= (8, 0))


def _step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, kind: str
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(out [B, h, m, D], lse [B, h, m] fp32, bytes allocated)`` of queries ``q [B, h, m, D]``
    over dense ``k``/``v`` ``[B, h, s, D]`` (contiguous along D). ``kind`` (`_step_kind`):
    ``"cpu"`` PyTorch's CPU flash kernel; ``"flash"`` its CUDA flash kernel (fp16/bf16);
    ``"efficient"`` its CUDA memory-efficient kernel (any float dtype; its log-sum-exp is
    padded to a multiple of 32 queries, sliced here, counted whole); ``"fallback"`` fp32
    scores for the block (small blocks).
    """
    if kind == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=scale)
    elif kind == "flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, False, False, scale=scale)[:2]
    elif kind == "efficient":
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, False, scale=scale)[:2]
    else:
        s = (q @ k.transpose(-1, -2)).float() * scale  # [B, h, m, s]
        lse = torch.logsumexp(s, dim=-1)
        out = torch.exp(s - lse.unsqueeze(-1)).to(v.dtype) @ v
    return out, lse[:, :, : q.shape[2]], out.nbytes + lse.nbytes


def _step_kind(q: torch.Tensor) -> str:
    """The `_step` kind for queries ``q`` (their device, dtype and head_dim)."""
    if q.device.type == "cpu":
        return "cpu"
    if q.device.type == "cuda" and q.shape[-1] % 8 == 0:
        cap = torch.cuda.get_device_capability(q.device)
        return "flash" if cuda_flash_supported(q.dtype, q.shape[-1], cap) else "efficient"
    return "fallback"


#: queries per block of the decode path's step, by `_step_kind` (the CPU flash kernel: 512; the
#: fp32 fallback: 64)
_DECODE_BLOCK = {"cpu": 512, "flash": GPU_QUERY_BLOCK, "efficient": GPU_QUERY_BLOCK, "fallback": 64}


# ---------------------------------------------------------------------------------------------
# The fused path (triton is optional: a record type's kernel module is imported on first use)
# ---------------------------------------------------------------------------------------------
#: `AttendStats.decode_reasons` when the default path on CUDA cannot take the fused path
NO_TRITON = ("triton does not import: packed segments are decoded before attention (install "
             "causalkv[triton] for the fused packed-attention kernel)")


def _use_fused(fused: bool | None, device: torch.device, st: AttendStats) -> bool:
    if fused and not triton_impl.AVAILABLE:
        raise AttendError(
            "attend(fused=True) needs triton for the packed-attention kernel; install "
            "causalkv[triton], or pass fused=False to decode packed segments first"
        )
    if fused is not None:
        return bool(fused)
    if device.type == "cuda" and not triton_impl.AVAILABLE:
        st.note(NO_TRITON)
    return device.type == "cuda" and triton_impl.AVAILABLE


# ---------------------------------------------------------------------------------------------
# attend
# ---------------------------------------------------------------------------------------------
def attend(
    query: torch.Tensor,
    view: CausalAttentionKVView,
    *,
    scale: float | None = None,
    stats: AttendStats | None = None,
    fused: bool | None = None,
) -> torch.Tensor:
    """Softmax attention of ``query`` ``[B, n, h, D]`` over every visible token of ``view``.

    Equals ``attend_dense(query, view.k, view.v)`` up to floating-point rounding. A view
    whose K/V are already materialized (every dense cache view) goes straight to SDPA;
    otherwise each segment's partial result is merged with the log-sum-exp recurrence in
    float32, so a packed view is never materialized whole.

    Args:
        fused: ``None`` (default): the fused path on CUDA when triton imports, the decode path
            elsewhere. ``True``: the fused path (packed segments read in place by the Triton
            kernel; on CPU tensors this needs ``TRITON_INTERPRET=1``). ``False``: the decode
            path (each packed segment dequantized, then attended).
        stats: filled with what the call did and held (see `AttendStats`), and why packed
            segments were decoded (``decode_reasons``: the caller reports them; `attend` logs
            nothing).

    Returns ``[B, n, h, D]`` in ``query.dtype``.

    Raises:
        AttendError: the view has no visible tokens, or ``fused=True`` without triton.
        PackedAttentionError: ``fused=True`` and a packed segment the kernel cannot take.
    """
    if view.num_rows == 0:
        raise AttendError("attend: the view has no visible tokens; write a chunk first")
    if view.is_materialized:
        # K/V in the query's dtype, as every segment is on the merge path below, so a query
        # of another dtype gets the same answer wherever the view is stored
        return attend_dense(query, view.k.to(query.dtype), view.v.to(query.dtype), scale=scale)
    return _attend_segments(query, view, scale=scale, stats=stats, fused=fused)


@torch.compiler.disable(reason="a view's segments are a Python loop (packed ones decoded); one break")
def _attend_segments(
    query: torch.Tensor,
    view: CausalAttentionKVView,
    *,
    scale: float | None,
    stats: AttendStats | None,
    fused: bool | None,
) -> torch.Tensor:
    """`attend` over a view whose K/V are not materialized: segment by segment, merged with the
    log-sum-exp recurrence. Runs outside torch.compile's graphs.

    The decode path reads `iter_segments` (packed segments dequantized by the view) with
    `_DECODE_BLOCK` queries per step. The fused path reads `iter_stored_segments`: packed
    records through their kernel (merged in place), records without one decoded here, and
    dense pieces (views of the cache) attended over `GPU_QUERY_BLOCK` queries."""
    b, n, h, d = query.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    st = stats if stats is not None else AttendStats()
    use_fused = _use_fused(fused, query.device, st)
    q = query.transpose(1, 2)  # [B, h, n, D], a view
    acc = torch.zeros((b, h, n, d), dtype=torch.float32, device=query.device)
    lse_run = torch.full((b, h, n), -math.inf, dtype=torch.float32, device=query.device)
    st.accumulator_nbytes = acc.nbytes + lse_run.nbytes
    kind = _step_kind(query)
    block = GPU_QUERY_BLOCK if use_fused else _DECODE_BLOCK[kind]

    def merge(k: torch.Tensor, v: torch.Tensor, extra: int) -> None:
        """Merge the attention of ``q`` over dense ``k``/``v`` ``[B, h, s, D]`` into ``acc`` /
        ``lse_run``, ``block`` queries at a time; ``extra``: bytes of the K/V temporaries that
        are live meanwhile. The fused path adds the weighted output with one ``addcmul_`` (no
        fp32 copy of the block's output); the decode path through an fp32 product."""
        for q0 in range(0, n, block):
            q1 = min(n, q0 + block)
            out, lse, made = _step(q[:, :, q0:q1], k, v, scale, kind=kind)
            run = lse_run[:, :, q0:q1]
            m = torch.maximum(run, lse)
            w_old, w_new = torch.exp(run - m), torch.exp(lse - m)
            total = w_old + w_new
            a = acc[:, :, q0:q1]
            a.mul_((w_old / total).unsqueeze(-1))
            if use_fused:
                a.addcmul_(out, (w_new / total).unsqueeze(-1))
            else:
                a.add_(out.float() * (w_new / total).unsqueeze(-1))
            run.copy_(m + torch.log(total))
            # what the step allocated (its output and log-sum-exp), the output's fp32 weighted
            # product (decode path), and the merge's four [B, h, m] temporaries
            product = 0 if use_fused else out.nbytes * (4 // out.element_size())
            block_bytes = made + product + 4 * lse.nbytes
            st.peak_transient_nbytes = max(st.peak_transient_nbytes, extra + block_bytes)
            del out, lse, m, w_old, w_new, total

    for k_seg, v_seg in view.iter_stored_segments() if use_fused else view.iter_segments():
        st.segments += 1
        record = record_kind(k_seg)  # a packed record: the fused path's stored pieces only
        if record is not None:
            why: str | None = "the codec has no attention kernel"
            kernel: ModuleType | None = None
            if record.attention_module is not None:
                kernel = importlib.import_module(record.attention_module)
                why = kernel.supports(query, k_seg, v_seg)
            if kernel is not None and why is None:
                kernel.packed_attention(query, k_seg, v_seg, scale=scale,
                                        merge_into=(acc.transpose(1, 2), lse_run))
                st.fused_segments += 1
                st.peak_segment_nbytes = max(st.peak_segment_nbytes, k_seg.nbytes + v_seg.nbytes)
                st.peak_transient_nbytes = max(st.peak_transient_nbytes,
                                               kernel.workspace_nbytes(k_seg, v_seg))
                continue
            if fused is True and kernel is not None:
                raise kernel.PackedAttentionError(f"attend(fused=True): {why}")
            st.note(f"packed segment decoded before attention ({why})")
            st.decoded_segments += 1
            k = decode_record(k_seg, query.dtype)  # [B, h, s, D]
            v = decode_record(v_seg, query.dtype)
            extra = seg = k.nbytes + v.nbytes
        else:
            k, v = k_seg.transpose(1, 2), v_seg.transpose(1, 2)  # views of the segment
            extra = seg = k.nbytes + v.nbytes
            cast = k.dtype != q.dtype
            k, v = k.to(q.dtype), v.to(q.dtype)
            if use_fused:
                # the decode path's segments are this call's (dequantized by the view); the fused
                # path's are the cache's own, so only a cast of them is this call's
                seg = k.nbytes + v.nbytes
                extra = seg if cast else 0
        st.peak_segment_nbytes = max(st.peak_segment_nbytes, seg)
        merge(k, v, extra)
        del k, v, k_seg, v_seg
    return acc.transpose(1, 2).to(query.dtype)


# ---------------------------------------------------------------------------------------------
# The hosts' route override (tests and benchmarks)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ForcedRoute:
    """What `forced_route` set: whether a host sends its attention over packed segments
    through `attend` (``routed``; False: the host's own path over the gathered K/V), attend's
    ``fused`` argument, and ``record``, a list that receives what the host records of each
    routed call (its `AttendStats`, alone or with the segment view), None: nothing."""

    routed: bool = True
    fused: bool | None = False
    record: list | None = field(default=None, repr=False)


_forced: ForcedRoute | None = None


@contextmanager
def forced_route(*, routed: bool = True, fused: bool | None = False,
                 record: list | None = None) -> Iterator[ForcedRoute]:
    """While the block runs, a host routes attention over packed segments on any device (not
    only CUDA): through `attend` with ``fused`` (``False``: the decode path; ``True``: the
    Triton kernel, on the CPU under ``TRITON_INTERPRET=1``; ``None``: attend's default), or
    with ``routed=False`` its own path, on CUDA too. For the tests and the benchmarks: the
    product routes on CUDA with attend's default. Blocks nest; the innermost one holds."""
    global _forced
    before, _forced = _forced, ForcedRoute(routed, fused, record)
    try:
        yield _forced
    finally:
        _forced = before


def route_override() -> ForcedRoute | None:
    """The `forced_route` that holds now, None outside one."""
    return _forced
