"""`packed_attention` (Triton flash attention over PRQ-packed K/V) and `attend`'s fused path.

Oracle: the PyTorch codec decodes the segment (``dequantize(..., dtype=float32,
backend="torch")``), then exact softmax attention in float64. Two comparisons per case:

- ``exact``: against that oracle as is (reported; the error of attending in the query dtype);
- ``rounded``: against the same oracle with the decoded K/V rounded to the query dtype first
  (what decode-to-bf16-then-attend sees). The kernel rounds its decoded float32 tiles the
  same way, so the only differences left are float32 accumulation and two documented
  roundings: the softmax weights before ``P V`` and the output (each at most the dtype's
  unit roundoff ``u`` relative). Asserted: ``|lse - lse*| <= 2e-5 * (1 + |lse*|)`` and
  ``|out - out*| <= u * (max|v| + max|out*|) + 2e-5 * max|v|``.

``TRITON_INTERPRET`` only takes effect if set before triton is first imported, so (as in
test_codec_triton.py) one test here re-runs this file in a fresh interpreter with
``TRITON_INTERPRET=1``, where the kernel cases are defined. Shapes stay small. The max
errors of every case print as a table with
``TRITON_INTERPRET=1 .venv/bin/python tests/test_packed_attention.py``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from interpreter import INTERPRETED, run_interpreted

from causalkv.caches import CausalCacheSpec, QVGPackedCausalKVCache
from causalkv.caches import attention as attn
from causalkv.caches.codecs.prq import PackedSegment, dequantize, quantize
from causalkv.caches.qvg import QVGKVQuantArgs

ROOT = Path(__file__).resolve().parents[1]
UNIT_ROUNDOFF = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


# ---------------------------------------------------------------------------------------------
# data and oracle (both processes)
# ---------------------------------------------------------------------------------------------
def kv_like(B: int, H: int, S: int, D: int, seed: int, *, zero_block: int = 0) -> torch.Tensor:
    """Clustered bf16 tokens ``[B, H, S, D]`` (16 prototypes per head + noise), heads scaled
    by different powers of two (so their scale exponents differ); with ``zero_block`` the
    first ``zero_block`` channels of every 7th token are exact zeros."""
    g = torch.Generator().manual_seed(seed)
    protos = torch.randn(B, H, 16, D, generator=g)
    which = torch.randint(0, 16, (B, H, S), generator=g)
    x = torch.gather(protos, 2, which.unsqueeze(-1).expand(-1, -1, -1, D))
    x = x + 0.3 * torch.randn(B, H, S, D, generator=g)
    gain = 2.0 ** torch.arange(-2, 2 * H - 2, 2, dtype=torch.float32)[:H]
    x = x * gain.view(1, H, 1, 1) / math.sqrt(D) * 4
    if zero_block:
        x[:, :, ::7, :zero_block] = 0
    return x.to(torch.bfloat16)


def oracle(query: torch.Tensor, k, v, scale: float, dtype: torch.dtype | None = None):
    """(out [B, n, H, D], lse [B, H, n]) float64 over the PyTorch codec's decode of ``k``/``v``
    (rounded to ``dtype`` first when given)."""
    kd = dequantize(k, dtype=torch.float32, backend="torch")
    vd = dequantize(v, dtype=torch.float32, backend="torch")
    if dtype is not None:
        kd, vd = kd.to(dtype), vd.to(dtype)
    q = query.double().transpose(1, 2)
    s = (q @ kd.double().transpose(-1, -2)) * scale
    lse = torch.logsumexp(s, dim=-1)
    out = torch.softmax(s, dim=-1) @ vd.double()
    return out.transpose(1, 2), lse, vd.double().abs().max().item()


@dataclass
class Errors:
    """Max abs errors of one case: output and lse against the exact and the rounded oracle."""

    out_exact: float = 0.0
    lse_exact: float = 0.0
    out_rounded: float = 0.0
    lse_rounded: float = 0.0
    out_tol: float = 0.0
    lse_tol: float = 0.0
    notes: list[str] = field(default_factory=list)


def check(query, k, v, out, lse, scale=None) -> Errors:
    """Compare a kernel result with both oracles; assert the rounded-oracle bounds."""
    D = query.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    assert out.dtype == query.dtype and out.shape == query.shape
    assert lse.dtype == torch.float32 and tuple(lse.shape) == (query.shape[0], query.shape[2], query.shape[1])
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    ex_out, ex_lse, _ = oracle(query, k, v, scale)
    r_out, r_lse, vmax = oracle(query, k, v, scale, query.dtype)
    e = Errors(
        out_exact=(out.double() - ex_out).abs().max().item(),
        lse_exact=(lse.double() - ex_lse).abs().max().item(),
        out_rounded=(out.double() - r_out).abs().max().item(),
        lse_rounded=((lse.double() - r_lse).abs() / (1 + r_lse.abs())).max().item(),
    )
    u = UNIT_ROUNDOFF[query.dtype]
    e.out_tol = u * (vmax + r_out.abs().max().item()) + 2e-5 * vmax
    e.lse_tol = 2e-5
    assert e.lse_rounded <= e.lse_tol, e
    assert e.out_rounded <= e.out_tol, e
    return e


def args_of(bits: int, block: int, **kw) -> QVGKVQuantArgs:
    return QVGKVQuantArgs(codec=f"int{bits}", block_size=block, centroids=kw.pop("centroids", 16), **kw)


def pack(x: torch.Tensor, args: QVGKVQuantArgs, **kw):
    return quantize(x, args, seed=7, backend="torch", **kw)


# ---------------------------------------------------------------------------------------------
# The kernel cases (run in the interpreted child; listed here so the table can print them)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    name: str
    bits: int = 2
    block: int = 32
    D: int = 64
    S: int = 100
    n: int = 40
    B: int = 1
    H: int = 2
    dtype: torch.dtype = torch.bfloat16
    asym: bool = False
    grid: str = "reference"
    stages: int = 1
    zero_block: int = 0
    v_bits: int | None = None  # V packed with other bits than K
    tiles: tuple[int, int] | None = None
    heads: tuple[int, int] | None = None  # attend a select_heads view of a wider segment
    tokens: tuple[int, int] | None = None  # attend a select_tokens view
    strided_query: bool = False


TILE = 64  # BLOCK_N of the default tile (`attention._tiles`): the S values below straddle it
CASES = [
    Case("int2 sym blk32 D64 s=100 (1.6 tiles)", bits=2, block=32, D=64, S=100),
    Case("int2 sym blk64 D64 fp16", bits=2, block=64, D=64, S=100, dtype=torch.float16),
    Case("int2 sym blk64 D64 fp32", bits=2, block=64, D=64, S=100, dtype=torch.float32),
    Case("int4 sym blk64 D128", bits=4, block=64, D=128, S=100),
    Case("int4 sym blk128 D128 fp32", bits=4, block=128, D=128, S=90, dtype=torch.float32),
    Case("int2 asym blk128 D128 s=20 (< tile) n=1", bits=2, block=128, D=128, S=20, n=1,
         asym=True),
    Case("int4 asym blk32 D64 s=64 n=130 (2 query tiles)", bits=4, block=32, D=64, S=TILE,
         n=130, asym=True),
    Case("int2 asym blk64 D128 fp16 B=2", bits=2, block=64, D=128, S=70, B=2, asym=True,
         dtype=torch.float16),
    Case("int2 mse4 blk32 D64 fp32", bits=2, block=32, D=64, S=77, n=33, grid="mse4",
         dtype=torch.float32),
    Case("int4 2 stages blk64 D64", bits=4, block=64, D=64, S=90, stages=2),
    Case("int2 zero blocks blk32 D64", bits=2, block=32, D=64, S=100, zero_block=32),
    Case("int4 asym zero blocks blk64 D128 fp32", bits=4, block=64, D=128, S=50, asym=True,
         zero_block=64, dtype=torch.float32),
    Case("K int4 / V int2 blk32 D64", bits=4, v_bits=2, block=32, D=64, S=80),
    Case("s=1 n=1 D64", bits=2, block=32, D=64, S=1, n=1),
    Case("tiles 16x16 (7 key x 3 query tiles) fp32", bits=2, block=32, D=64, S=100, n=40,
         tiles=(16, 16), dtype=torch.float32),
    Case("tiles 128x128 (GPU sweep tile) s=300 D128", bits=2, block=64, D=128, S=300, n=40,
         tiles=(128, 128)),
    Case("tiles 64x32 s=100 n=70 D128 fp16", bits=4, block=32, D=128, S=100, n=70,
         tiles=(64, 32), dtype=torch.float16),
    Case("head slice [1, 3) of B=2 H=4 (strided)", bits=4, block=32, D=64, S=60, B=2, H=4,
         heads=(1, 3)),
    Case("token slice [13, 85) of s=100", bits=2, block=64, D=64, S=100, tokens=(13, 85),
         asym=True),
    Case("strided query (q of a qkv buffer)", bits=2, block=32, D=64, S=50, n=24,
         strided_query=True, dtype=torch.float32),
]


def build(case: Case):
    """(query [B, n, h, D], k, v) of ``case``."""
    B, H, S, D = case.B, case.H, case.S, case.D
    ka = args_of(case.bits, case.block, asymmetric=case.asym, grid=case.grid, stages=case.stages)
    va = args_of(case.v_bits or case.bits, case.block, asymmetric=case.asym, grid=case.grid,
                 stages=case.stages)
    k = pack(kv_like(B, H, S, D, seed=1, zero_block=case.zero_block), ka)
    v = pack(kv_like(B, H, S, D, seed=2, zero_block=case.zero_block), va)
    if case.zero_block:
        assert (k.scales.view(torch.uint8) == 0x80).any() and (v.scales.view(torch.uint8) == 0x80).any()
    h = H
    if case.heads is not None:
        k, v = k.select_heads(*case.heads), v.select_heads(*case.heads)
        assert not k.codes.is_contiguous()
        h = case.heads[1] - case.heads[0]
    if case.tokens is not None:
        k, v = k.select_tokens(*case.tokens), v.select_tokens(*case.tokens)
        assert not k.codes.is_contiguous()
    g = torch.Generator().manual_seed(3)
    if case.strided_query:
        qkv = torch.randn(B, case.n, 3 * h, D, generator=g).to(case.dtype)
        query = qkv[:, :, h : 2 * h]
        assert not query.is_contiguous()
    else:
        query = torch.randn(B, case.n, h, D, generator=g).to(case.dtype)
    return query, k, v


def run_case(case: Case) -> Errors:
    from causalkv.caches.codecs.prq.attention import packed_attention

    query, k, v = build(case)
    out, lse = packed_attention(query, k, v, tiles=case.tiles)
    return check(query, k, v, out, lse)


# ---------------------------------------------------------------------------------------------
# In the normal process: the interpreted child, and what needs no kernel launch
# ---------------------------------------------------------------------------------------------
if not INTERPRETED:

    def test_packed_attention_cases_under_the_interpreter():
        run_interpreted(__file__)

    def test_packed_attention_refuses_cpu_tensors_without_the_interpreter():
        from causalkv.caches.codecs.prq.attention import PackedAttentionError, packed_attention

        query, k, v = build(CASES[0])
        with pytest.raises(PackedAttentionError, match="TRITON_INTERPRET=1"):
            packed_attention(query, k, v)

    def test_packed_attention_refuses_bad_inputs_naming_them():
        from causalkv.caches.codecs.prq.attention import PackedAttentionError, packed_attention

        query, k, v = build(CASES[0])
        bad = [
            (query[:, :, :1], k, v, "B, H and D must agree"),
            (query.to(torch.float64), k, v, "query dtype"),
            (query, k, v.select_tokens(0, 50), "k has 100 tokens, v 50"),
            (query, k, query, "v must be a codec PackedSegment"),
            (query[0], k, v, r"query must be \[B, n, H, D\]"),
        ]
        for q, kk, vv, msg in bad:
            with pytest.raises(PackedAttentionError, match=msg):
                packed_attention(q, kk, vv)
        x = kv_like(1, 2, 20, 48, seed=0)
        k48 = pack(x, args_of(2, 16))
        with pytest.raises(PackedAttentionError, match="power of two"):
            packed_attention(torch.zeros(1, 3, 2, 48), k48, k48)
        for scale in (True, float("nan"), float("inf"), 0.0):  # True is not a scale of 1.0
            with pytest.raises(PackedAttentionError, match="scale must be a finite float > 0"):
                packed_attention(query, k, v, scale=scale)
        assert issubclass(PackedAttentionError, ValueError)

    def test_select_tokens_views_decode_the_same_rows():
        x = kv_like(2, 3, 50, 32, seed=4, zero_block=16)
        for args in (args_of(2, 16), args_of(4, 16, asymmetric=True), args_of(2, 8, stages=2)):
            p = pack(x, args)
            whole = dequantize(p, dtype=torch.float32)
            part = p.select_tokens(7, 31)
            assert part.shape == (2, 3, 24, 32) and part.codes.data_ptr() == p.codes[:, :, 7].data_ptr()
            assert torch.equal(dequantize(part, dtype=torch.float32), whole[:, :, 7:31])
        with pytest.raises(ValueError, match="select_tokens"):
            p.select_tokens(10, 10)

    def test_cuda_flash_choice():
        ok = attn.cuda_flash_supported
        assert ok(torch.bfloat16, 128, (9, 0)) and ok(torch.float16, 64, (8, 0))
        assert not ok(torch.float32, 128, (9, 0))  # flash takes fp16/bf16 only
        assert not ok(torch.bfloat16, 128, (7, 5))  # pre-Ampere: memory-efficient kernel
        assert not ok(torch.bfloat16, 100, (9, 0)) and not ok(torch.bfloat16, 512, (9, 0))

    @pytest.mark.parametrize("flash", [True, False], ids=["flash", "efficient"])
    def test_cuda_attention_with_lse_shapes_on_meta(flash):
        """The exact aten calls the CUDA dense step makes, on meta tensors: the output and a
        [B, h, m] log-sum-exp (the efficient kernel's 32-padded one sliced), and the bytes."""
        q = torch.empty(2, 3, 70, 64, device="meta", dtype=torch.bfloat16)
        k = torch.empty(2, 3, 50, 64, device="meta", dtype=torch.bfloat16)
        out, lse, made = attn._step(q, k, k, 0.125, kind="flash" if flash else "efficient")
        assert out.shape == q.shape and tuple(lse.shape) == (2, 3, 70)
        assert lse.dtype == torch.float32
        padded = 70 if flash else 96
        assert made == out.nbytes + 2 * 3 * padded * 4

    def test_attend_on_cpu_defaults_to_the_decode_path():
        view, query = _stream_view(torch.bfloat16, D=32, n=20)
        st = attn.AttendStats()
        out = attn.attend(query, view, stats=st)
        assert st.fused_segments == 0 and st.segments > 1
        ref = attn.attend_dense(query.double(), view.k.double(), view.v.double())
        assert (out.double() - ref).abs().max() < 2e-2

    def test_attend_fused_without_triton_is_refused(monkeypatch):
        monkeypatch.setattr(attn.triton_impl, "AVAILABLE", False)
        view, query = _stream_view(torch.bfloat16, D=32, n=20)
        with pytest.raises(attn.AttendError, match="needs triton"):
            attn.attend(query, view, fused=True)

    def test_without_triton_cudas_default_records_why_it_decodes_and_logs_nothing(monkeypatch, caplog):
        monkeypatch.setattr(attn.triton_impl, "AVAILABLE", False)
        st = attn.AttendStats()
        with caplog.at_level("DEBUG"):
            assert attn._use_fused(None, torch.device("cuda"), st) is False
            assert attn._use_fused(None, torch.device("cuda"), st) is False
        assert st.decode_reasons == [attn.NO_TRITON] and "triton does not import" in attn.NO_TRITON
        assert caplog.records == []  # the caches print nothing: the host reports

    def test_a_segment_the_kernel_does_not_take_is_decoded_and_the_reason_recorded(monkeypatch, caplog):
        view, query = _stream_view(torch.float32, D=48, n=20)
        monkeypatch.setattr(attn, "_use_fused", lambda fused, device, st: True)  # CUDA's default path
        st = attn.AttendStats()
        with caplog.at_level("DEBUG"):
            out = attn.attend(query, view, stats=st)
        assert st.decoded_segments >= 1 and st.fused_segments == 0
        assert len(st.decode_reasons) == 1, st.decode_reasons  # each reason once, however many segments
        assert st.decode_reasons[0].startswith("packed segment decoded before attention (")
        assert caplog.records == []
        ref = attn.attend_dense(query.double(), view.k.double(), view.v.double())
        assert (out.double() - ref).abs().max() < 1e-3

    def test_causalkvs_wan_processor_reports_each_decode_reason_once(monkeypatch, capsys):
        from causalkv.runtime.model_io import causal_wan

        monkeypatch.setattr(attn, "_REPORTED", set())
        st = attn.AttendStats()
        st.note("packed segment decoded before attention (why)")
        st.note("packed segment decoded before attention (why)")
        causal_wan.report_attend(st)
        causal_wan.report_attend(st)
        assert capsys.readouterr().err.splitlines() == [
            "causalkv: warning: attention: packed segment decoded before attention (why)"]

    def test_gpu_attention_benchmark_says_it_needs_cuda():
        proc = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "gpu_attention.py")],
            capture_output=True, text=True, timeout=300,
        )
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "needs a CUDA device" in proc.stderr and "--interpret" in proc.stderr


# ---------------------------------------------------------------------------------------------
# attend's fused path over real cache views (both processes build them)
# ---------------------------------------------------------------------------------------------
def _stream_view(dtype, *, D=64, n=48, H=2, chunks=9, span=1, pin_at=None, recent=None,
                 heads=None, keep_recent=1):
    """A packed cache streamed ``chunks`` chunks of ``n`` tokens (sink 1 chunk, window 5);
    returns (view of the last write, query [1, n, h, D])."""
    spec = CausalCacheSpec(batch_size=1, num_heads=H, head_dim=D, cache_size=6 * n, sink_tokens=n,
                       global_sink_tokens=n, dtype=torch.bfloat16)
    q = QVGKVQuantArgs(codec="int2", centroids=8, block_size=32 if D % 32 == 0 else 16,
                       keep_recent_chunks=keep_recent, span_chunks=span).validate()
    cache = QVGPackedCausalKVCache(spec, q)
    view = None
    for i in range(chunks):
        x = kv_like(1, H, 2 * n, D, seed=100 + i)
        k, v = x[:, :, :n].transpose(1, 2), x[:, :, n:].transpose(1, 2)
        view = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=i * n,
                                                 recent_window_tokens=recent)
        if pin_at == i:
            cache.pin_current_chunk(n)
    if heads is not None:
        view = cache.get_attention_kv(cache_head_start=heads[0], num_heads=heads[1] - heads[0],
                                      recent_window_tokens=recent)
    h = H if heads is None else heads[1] - heads[0]
    query = torch.randn(1, n, h, D, generator=torch.Generator().manual_seed(9)).to(dtype)
    assert view is not None and not view.is_materialized
    return view, query


if INTERPRETED:  # the cases, run only in the interpreted child process

    @pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
    def test_packed_attention_matches_the_oracle(case):
        run_case(case)

    def test_head_offset_segment_equals_the_head_slice_bit_for_bit():
        """A rank's own segment (quantize with head_offset) and the same heads sliced out of
        the whole segment give the same bytes, so the kernel's outputs are equal too."""
        from causalkv.caches.codecs.prq.attention import packed_attention

        x = kv_like(1, 4, 70, 64, seed=11)
        args = args_of(2, 32)
        whole = pack(x, args)
        own = pack(x[:, 1:3], args, head_offset=1)
        query = torch.randn(1, 20, 2, 64).to(torch.bfloat16)
        a = packed_attention(query, own, own)
        b = packed_attention(query, whole.select_heads(1, 3), whole.select_heads(1, 3))
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        check(query, own, own, *a)

    def test_merge_into_equals_attention_over_both_segments():
        """Two segments merged in the kernel's epilogue = one attention over their union."""
        from causalkv.caches.codecs.prq.attention import packed_attention

        x = kv_like(1, 2, 150, 64, seed=12)
        args = args_of(4, 32)
        p = pack(x, args)
        query = torch.randn(1, 30, 2, 64)
        acc = torch.zeros(1, 2, 30, 64).transpose(1, 2)  # strided [B, n, H, D]
        lse = torch.full((1, 2, 30), -math.inf)
        for s0, s1 in ((0, 90), (90, 150)):
            got = packed_attention(query, p.select_tokens(s0, s1), p.select_tokens(s0, s1),
                                   merge_into=(acc, lse))
            assert got[0] is acc and got[1] is lse
        ref, ref_lse, _ = oracle(query, p, p, 1 / 8)
        assert (acc.double() - ref).abs().max() < 2e-5
        assert (lse.double() - ref_lse).abs().max() < 2e-5

    @pytest.mark.parametrize(
        "kw",
        [dict(), dict(span=2, chunks=8), dict(pin_at=4, recent=96),
         dict(heads=(1, 2), H=3, keep_recent=0), dict(D=128, n=40, keep_recent=0)],
        ids=["window", "span2-partial", "pinned+recent", "head-slice", "D128-no-recent"],
    )
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
    def test_fused_attend_matches_attend_dense_over_the_view(kw, dtype):
        """attend(fused=True) over a packed view: every packed piece through the kernel, the
        merged result against attend_dense over the materialized view (float64)."""
        view, query = _stream_view(dtype, **kw)
        pieces = list(view.iter_stored_segments())
        packed = sum(isinstance(p[0], PackedSegment) for p in pieces)
        assert packed >= 1
        st = attn.AttendStats()
        out = attn.attend(query, view, stats=st, fused=True)
        assert not view.is_materialized
        assert st.segments == len(pieces) and st.fused_segments == packed
        assert st.decoded_segments == 0
        # the oracle: the stored pieces decoded by the PyTorch codec in float32, rounded to
        # the query dtype as the kernel rounds its tiles, exact attention in float64
        ks, vs = [], []
        for k, v in pieces:
            if isinstance(k, PackedSegment):
                k = dequantize(k, dtype=torch.float32, backend="torch").transpose(1, 2)
                v = dequantize(v, dtype=torch.float32, backend="torch").transpose(1, 2)
            ks.append(k.to(dtype).double())
            vs.append(v.to(dtype).double())
        k64, v64 = torch.cat(ks, dim=1), torch.cat(vs, dim=1)
        assert k64.shape[1] == view.num_visible
        ref = attn.attend_dense(query.double(), k64, v64)
        u = UNIT_ROUNDOFF[dtype]
        vmax = v64.abs().max().item()
        # per segment: the kernel's bound; across segments: the fp32 merge
        tol = 2 * u * (vmax + ref.abs().max().item()) + 5e-5 * vmax
        assert (out.double() - ref).abs().max().item() <= tol
        if dtype == torch.bfloat16:  # the materialized view holds the same bf16 K/V
            dense = attn.attend_dense(query.double(), view.k.double(), view.v.double())
            assert (out.double() - dense).abs().max().item() <= tol
        # no decoded segment: the transient is the dense pieces' step only (their K/V are
        # views of the cache; a float32 query needs float32 copies of them), with all n <=
        # GPU_QUERY_BLOCK queries in one block: its output and log-sum-exp and four
        # [B, h, n] merge temporaries (the output is merged in place)
        n, h, D = query.shape[1], query.shape[2], query.shape[3]
        es = query.element_size()
        block = n * h * D * es + n * h * 4 + 4 * n * h * 4
        expected = max([0] + [
            block + (0 if p[0].dtype == dtype else p[0].numel() * es * 2)
            for p in pieces if isinstance(p[0], torch.Tensor)])
        assert st.peak_transient_nbytes == expected

    def test_fused_attend_refuses_a_segment_the_kernel_cannot_take():
        from causalkv.caches.codecs.prq.attention import PackedAttentionError

        view, query = _stream_view(torch.float32, D=48, n=20)
        with pytest.raises(PackedAttentionError, match="power of two"):
            attn.attend(query, view, fused=True)

    def test_gpu_attention_benchmark_interpret_smoke(tmp_path):
        out = tmp_path / "bench.json"
        proc = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "gpu_attention.py"), "--interpret",
             "--json", str(out)],
            capture_output=True, text=True, timeout=600, env=dict(os.environ),
        )
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        data = json.loads(out.read_text())
        assert data["mode"] == "interpret" and data["ok"]
        assert {r["bits"] for r in data["rows"]} == {2, 4}
        for r in data["rows"]:
            assert r["fused_max_abs_err"] <= r["fused_err_bound"]
            assert r["attend_fused_transient_bytes"] < r["attend_decode_transient_bytes"]


def main() -> None:
    """Print the kernel cases' max errors (run under TRITON_INTERPRET=1)."""
    if not INTERPRETED:
        raise SystemExit("run with TRITON_INTERPRET=1 (the kernel runs on the CPU interpreter)")
    print("| case | query | out err (exact) | lse err (exact) | out err (rounded) | bound | "
          "lse rel err (rounded) | bound |")
    print("|---|---|---|---|---|---|---|---|")
    for case in CASES:
        e = run_case(case)
        print(f"| {case.name} | {str(case.dtype).removeprefix('torch.')} | {e.out_exact:.2e} | "
              f"{e.lse_exact:.2e} | {e.out_rounded:.2e} | {e.out_tol:.2e} | "
              f"{e.lse_rounded:.2e} | {e.lse_tol:.0e} |")



def test_forced_route_holds_only_inside_its_block_and_nests() -> None:
    """The hosts' override: None outside any block; the innermost block holds; each block's
    exit (an exception included) gives back the one outside it."""
    assert attn.route_override() is None
    record: list = []
    with attn.forced_route(fused=None, record=record) as outer:
        assert attn.route_override() is outer and outer == attn.ForcedRoute(True, None, record)
        with pytest.raises(RuntimeError), attn.forced_route(routed=False):
            assert attn.route_override() == attn.ForcedRoute(routed=False)
            raise RuntimeError("the block fails")
        assert attn.route_override() is outer
    assert attn.route_override() is None

if __name__ == "__main__":
    main()
