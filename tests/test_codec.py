"""PRQ codec (PyTorch path): byte layout, round-trip bounds vs a float64 decoder, edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from causalkv.caches.codecs.prq import (
    BACKEND_ENV,
    PackedSegment,
    bits_per_element,
    dequantize,
    packed_nbytes_formula,
    quantize,
    resolve_backend,
)
from causalkv.caches.codecs.prq import torch_impl as ti
from causalkv.caches.codecs.prq.format import ZERO_BLOCK_SCALE_BYTE, scale_exponents
from causalkv.caches.qvg import QVGKVQuantArgs

BF16_EPS = 2.0**-8  # relative rounding bound of bf16 (8 significant bits)


# ---- oracles ------------------------------------------------------------------------------
def fp8_e4m3_value(byte: int) -> float:
    """e4m3fn decoding from the format definition (no torch float8 involved)."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0:
        return sign * man / 8.0 * 2.0**-6
    return sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7)


def ref_decode(p: PackedSegment) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 reconstruction and per-element decoded step ``s``, straight from the bytes.

    Fields are read bit by bit in Python integer arithmetic, scales from the e4m3 definition.
    """
    B, H, S, D = p.shape
    bits, bs, per = p.bits, p.block_size, 8 // p.bits
    codes = p.codes.reshape(-1, D * bits // 8).to(torch.int64)
    fields = torch.stack([(codes >> (bits * j)) & ((1 << bits) - 1) for j in range(per)], -1)
    fields = fields.reshape(-1, D)
    v = torch.where(fields >= 2 ** (bits - 1), fields - 2**bits, fields).to(torch.float64)
    sb = p.scales.reshape(-1, D // bs).view(torch.uint8).to(torch.int64)
    table = torch.tensor([fp8_e4m3_value(b) for b in range(256)], dtype=torch.float64)
    # one exponent per (batch, head): row n of the N = B*H*S tokens belongs to head n // S
    exp = p.scale_exp.reshape(B * H).to(torch.float64).repeat_interleave(S).unsqueeze(1)
    s = (table[sb] * torch.exp2(exp)).abs().repeat_interleave(bs, dim=1)  # [N, D]
    if p.zeros is not None:
        level = v - p.zeros.reshape(-1, D // bs).to(torch.float64).repeat_interleave(bs, 1)
    elif p.grid == "mse4":
        level = 2 * v + 1
    else:
        level = v
    cent = torch.zeros(B * H * S, D, dtype=torch.float64)
    for c, ids in zip(p.centroids, p.ids):
        K = c.shape[2]
        flat = c.reshape(B * H, K, D).to(torch.float64)
        cent += torch.gather(flat, 1, ids.reshape(B * H, S, 1).long().expand(-1, -1, D)).reshape(-1, D)
    keep = (sb != ZERO_BLOCK_SCALE_BYTE).repeat_interleave(bs, dim=1).to(torch.float64)
    out = cent * keep + level * s
    return out.reshape(B, H, S, D), s.reshape(B, H, S, D)


def clustered(B=1, H=2, S=384, D=64, clusters=24, noise=0.15, seed=0) -> torch.Tensor:
    """Tokens = one of ``clusters`` prototype vectors + small Gaussian noise (bf16)."""
    g = torch.Generator().manual_seed(seed)
    protos = torch.randn(B, H, clusters, D, generator=g) * 2.0
    which = torch.randint(0, clusters, (B, H, S), generator=g)
    x = torch.gather(protos, 2, which.unsqueeze(-1).expand(-1, -1, -1, D))
    return (x + noise * torch.randn(B, H, S, D, generator=g)).to(torch.bfloat16)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    return float((a64 - b64).norm() / b64.norm())


def rtn_int2_asym(x: torch.Tensor, block: int) -> torch.Tensor:
    """Round-to-nearest, 4 levels, min/max per (token, block of channels), float64."""
    x64 = x.to(torch.float64)
    xb = x64.unflatten(-1, (-1, block))
    mn, mx = xb.amin(-1, keepdim=True), xb.amax(-1, keepdim=True)
    step = ((mx - mn) / 3).clamp_min(1e-30)
    return (torch.round((xb - mn) / step).clamp(0, 3) * step + mn).flatten(-2)


ARGS = {
    "int2": QVGKVQuantArgs(codec="int2", centroids=32, block_size=32),
    "int4": QVGKVQuantArgs(codec="int4", centroids=32, block_size=32),
    "int2-mse4": QVGKVQuantArgs(codec="int2", centroids=32, block_size=32, grid="mse4"),
    "int4-mse4": QVGKVQuantArgs(codec="int4", centroids=32, block_size=16, grid="mse4"),
    "int2-asym": QVGKVQuantArgs(codec="int2", centroids=32, block_size=32, asymmetric=True),
    "int4-asym": QVGKVQuantArgs(codec="int4", centroids=16, block_size=16, asymmetric=True),
    "int2-2stage": QVGKVQuantArgs(codec="int2", centroids=16, block_size=16, stages=2, kmeans_iters=3),
}


# ---- packing ------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 4])
def test_pack_unpack_every_code_roundtrips(bits):
    half = 2 ** (bits - 1)
    g = torch.Generator().manual_seed(1)
    v = torch.randint(-half, half, (5, 7, 64), generator=g).to(torch.int8)
    packed = ti.pack_fields(v, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 7, 64 * bits // 8)
    assert torch.equal(ti.unpack_levels(packed, bits), v)
    assert torch.equal(ti.unpack_levels(packed, bits, odd=True), 2 * v + 1)
    # the documented layout: channel i*P + j lives in bits [j*bits, (j+1)*bits) of byte i
    per = 8 // bits
    for i, j in [(0, 0), (3, per - 1), (10, 1)]:
        field = (int(packed[2, 4, i]) >> (bits * j)) & ((1 << bits) - 1)
        assert field == int(v[2, 4, i * per + j]) & ((1 << bits) - 1)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("odd", [False, True])
def test_bf16_level_table_matches_shift_unpack(bits, odd):
    lut = ti._lut(bits, odd, torch.bfloat16, False, torch.device("cpu"))
    byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = ti.unpack_levels(byte, bits, odd=odd).to(torch.bfloat16)
    assert torch.equal(lut.view(torch.bfloat16).view(256, -1).reshape(-1), want)


# ---- round trips ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(ARGS))
def test_dequantize_equals_float64_decoder(name):
    args = ARGS[name]
    x = clustered(S=200)
    p = quantize(x, args)
    ref, _ = ref_decode(p)
    y32 = dequantize(p, dtype=torch.float32)
    # float32 evaluation of sum(centroids) + level * s: within a few float32 ulps
    assert torch.allclose(y32.double(), ref, rtol=4 * 2.0**-24, atol=1e-30)
    y = dequantize(p)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert ((y.double() - ref).abs() <= ref.abs() * BF16_EPS * 1.01 + 1e-30).all()


@pytest.mark.parametrize("name", list(ARGS))
def test_the_threaded_and_the_serial_level_lookup_decode_the_same(name):
    """The level lookup takes a gather with intra-op threads and an index_select on one thread
    (`make test` runs its suites on one thread): both read the same table, so bit for bit."""
    p = quantize(clustered(S=200), ARGS[name])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = dequantize(p, dtype=torch.float32)
        torch.set_num_threads(2)
        threaded = dequantize(p, dtype=torch.float32)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(serial, threaded)


@pytest.mark.parametrize("name", ["int2", "int4", "int2-asym", "int4-asym"])
def test_error_within_half_step_of_stored_scale(name):
    """Symmetric scales round up and asymmetric zero points are integers: no code clips,
    so every element is within half a decoded step of its input."""
    args = ARGS[name]
    x = torch.randn(2, 3, 150, 64).to(torch.bfloat16) * 3
    p = quantize(x, args)
    ref, s = ref_decode(p)
    err = (ref - x.double()).abs()
    assert (err <= s / 2 * (1 + 1e-6) + 1e-12).all(), float((err - s / 2).max())


def test_bf16_range_inputs_are_power_of_two_equivariant():
    """Scaling the input by 2^k changes nothing but the exponents: same ids, codes, scale
    bytes; centroids and the reconstruction scale exactly (no fp32 overflow in k-means)."""
    args = QVGKVQuantArgs(codec="int2", centroids=16, block_size=32)
    x = torch.randn(1, 2, 96, 64).to(torch.bfloat16)
    base = quantize(x, args)
    y = dequantize(base, dtype=torch.float32)
    for k in (-100, -40, 60, 120):
        f = 2.0**k
        p = quantize(x * f, args)
        assert torch.equal(p.scale_exp, base.scale_exp + k)
        assert torch.equal(p.codes, base.codes) and torch.equal(p.ids[0], base.ids[0])
        assert torch.equal(p.scales.view(torch.uint8), base.scales.view(torch.uint8))
        assert torch.equal(p.centroids[0].double(), base.centroids[0].double() * f)
        yk = dequantize(p, dtype=torch.float32).double()
        assert torch.isfinite(yk).all()
        if abs(k) <= 60:  # float32 holds 2^k * y exactly
            assert torch.equal(yk, y.double() * f)


def test_int4_and_grids_on_gaussian_data():
    """iid Gaussian, S = 4 * K: int4 within 0.1 relative error (a 15-level absmax grid
    has step ~ 2.4 sigma / 7, rms error step / sqrt(12) ~ 0.1 sigma before k-means helps);
    the all-four-level mse4 grid beats the three-level reference grid at 2 bits."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 4, 512, 64, generator=g).to(torch.bfloat16)
    base = dict(centroids=128, block_size=64)
    e4 = rel_err(dequantize(quantize(x, QVGKVQuantArgs(codec="int4", **base))), x)
    e2 = rel_err(dequantize(quantize(x, QVGKVQuantArgs(codec="int2", **base))), x)
    e2m = rel_err(dequantize(quantize(x, QVGKVQuantArgs(codec="int2", grid="mse4", **base))), x)
    assert e4 <= 0.1
    assert e2m < e2 < 1.0


def test_prq_beats_round_to_nearest_on_clustered_data():
    x = clustered(S=512, D=64, clusters=24, noise=0.15)
    e_prq = rel_err(dequantize(quantize(x, QVGKVQuantArgs(codec="int2", block_size=64))), x)
    e_rtn = rel_err(rtn_int2_asym(x, 64), x)
    assert e_prq <= 0.5 * e_rtn, (e_prq, e_rtn)


# ---- bytes ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape,args",
    [
        ((1, 2, 300, 128), QVGKVQuantArgs(codec="int2")),
        ((2, 3, 40, 128), QVGKVQuantArgs(codec="int4")),  # S < centroids: K = S
        ((1, 2, 64, 64), QVGKVQuantArgs(codec="int2", asymmetric=True, block_size=16)),
        ((1, 1, 50, 32), QVGKVQuantArgs(codec="int4", stages=3, centroids=8, block_size=8)),
    ],
)
def test_nbytes_matches_formula_to_the_byte(shape, args):
    B, H, S, D = shape
    p = quantize(torch.randn(shape), args)
    assert p.nbytes == packed_nbytes_formula(shape, args)
    K = min(args.centroids, S)
    assert p.num_centroids == K
    hand = (
        B * H * S * D * args.bits // 8
        + B * H * S * (D // args.block_size) * (2 if args.asymmetric else 1)
        + args.stages * B * H * S
        + 2 * args.stages * B * H * K * D
        + 2 * B * H  # one int16 scale exponent per (batch, head)
    )
    assert p.nbytes == hand
    assert p.scale_exp.dtype == torch.int16 and p.scale_exp.shape == (B, H)
    assert p.nbytes * 8 == pytest.approx(bits_per_element(S, D, args) * B * H * S * D)
    assert p.codes.dtype == torch.uint8 and p.scales.dtype == torch.float8_e4m3fn
    assert all(i.dtype == torch.uint8 for i in p.ids)
    assert all(c.dtype == torch.bfloat16 and c.shape == (B, H, K, D) for c in p.centroids)


def test_reference_defaults_bits_per_element():
    # 2 + 8/64 + 8/128 + 16*128/S + 16/(S*128) at S = 4680 (one 3-frame Wan chunk)
    args = QVGKVQuantArgs(codec="int2")
    want = 2 + 0.125 + 0.0625 + 2048 / 4680 + 16 / (4680 * 128)
    assert bits_per_element(4680, 128, args) == pytest.approx(want, rel=1e-12)


# ---- determinism ------------------------------------------------------------------------------
def _bytes(p: PackedSegment) -> list[bytes]:
    ts = [p.codes, p.scales.view(torch.uint8), *p.ids, *[c.view(torch.int16) for c in p.centroids]]
    return [t.contiguous().numpy().tobytes() for t in ts]


def test_same_seed_same_bytes_and_global_rng_untouched():
    x = clustered(S=256)
    args = QVGKVQuantArgs(codec="int2", centroids=64, block_size=32, kmeans_iters=3)
    torch.manual_seed(99)
    state = torch.get_rng_state()
    a, b = quantize(x, args), quantize(x, args)
    assert torch.equal(torch.get_rng_state(), state)
    assert _bytes(a) == _bytes(b)
    c = quantize(x, args, seed=7)
    assert _bytes(c) != _bytes(a)


# ---- edge cases -------------------------------------------------------------------------------
@pytest.mark.parametrize("S", [1, 5, 31])
def test_fewer_tokens_than_centroids_is_lossless_for_bf16(S):
    """With S <= centroids every token is its own centroid: the residual is exactly zero."""
    x = torch.randn(2, 3, S, 64).to(torch.bfloat16)
    p = quantize(x, QVGKVQuantArgs(codec="int2", centroids=32))
    assert p.num_centroids == S
    assert torch.equal(dequantize(p), x)


def test_head_dim_not_divisible_by_block_size():
    with pytest.raises(ValueError, match="head_dim 96 is not divisible by block_size 64"):
        quantize(torch.randn(1, 1, 8, 96), QVGKVQuantArgs(codec="int2"))


def test_all_zero_blocks_decode_to_exact_zeros():
    x = torch.randn(1, 2, 64, 64).to(torch.bfloat16)
    x[0, 0, 5, 32:] = 0  # one block of one token
    x[0, 1, 10:20] = 0  # whole tokens
    x[0, 0, :, :16] = 0  # a channel range in every token (half of a 32-block)
    for args in (QVGKVQuantArgs(codec="int2", centroids=16, block_size=32),
                 QVGKVQuantArgs(codec="int4", centroids=16, block_size=16, asymmetric=True)):
        p = quantize(x, args)
        y = dequantize(p)
        assert not torch.isnan(y).any()
        assert (y[0, 0, 5, 32:] == 0).all() and (y[0, 1, 10:20] == 0).all()
        if args.block_size == 16:
            assert (y[0, 0, :, :16] == 0).all()
    z = torch.zeros(1, 2, 40, 64)
    p = quantize(z, QVGKVQuantArgs(codec="int2"))
    assert torch.equal(dequantize(p, dtype=torch.float32), z)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_is_rejected_with_a_count(bad):
    x = torch.randn(1, 2, 16, 64)
    x[0, 0, 1, 3] = bad
    x[0, 1, 7, 0] = bad
    x[0, 1, 8, 63] = bad
    with pytest.raises(ValueError, match=r"3 non-finite value\(s\) \(NaN or inf\) out of 2048"):
        quantize(x, QVGKVQuantArgs(codec="int2"))


def test_more_than_256_centroids_rejected():
    with pytest.raises(ValueError, match="<= 256 \\(cluster ids are uint8\\), got 300"):
        quantize(torch.randn(1, 1, 8, 64), QVGKVQuantArgs(codec="int2", centroids=300))


def test_quantization_off_or_bad_input_rejected():
    with pytest.raises(ValueError, match="quantization off"):
        quantize(torch.randn(1, 1, 8, 64), QVGKVQuantArgs())
    with pytest.raises(ValueError, match=r"\[B, H, S, D\]"):
        quantize(torch.randn(8, 64), QVGKVQuantArgs(codec="int2"))
    with pytest.raises(ValueError, match="whole number of bytes"):
        quantize(torch.randn(1, 1, 8, 64), QVGKVQuantArgs(codec="int2", block_size=2))
    p = quantize(torch.randn(1, 1, 8, 64), QVGKVQuantArgs(codec="int2"))
    with pytest.raises(ValueError, match="out has shape"):
        dequantize(p, out=torch.empty(1, 1, 9, 64))


# ---- layouts, moves, backends -----------------------------------------------------------------
def test_strided_input_and_out_view_of_a_larger_buffer():
    """`out` may be ``big.permute(0, 2, 1, 3)[:, :, a:b]`` of a ``[B, S, H, D]`` buffer."""
    x_bshd = clustered(B=2, H=3, S=50).permute(0, 2, 1, 3).contiguous()  # [B, S, H, D]
    x = x_bshd.permute(0, 2, 1, 3)  # non-contiguous [B, H, S, D]
    args = QVGKVQuantArgs(codec="int4", centroids=16, block_size=32)
    p = quantize(x, args)
    assert _bytes(p) == _bytes(quantize(x.contiguous(), args))
    want = dequantize(p)
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        big = torch.full((2, 70, 3, 64), 7.0, dtype=dtype)
        view = big.permute(0, 2, 1, 3)[:, :, 10:60]
        got = dequantize(p, out=view)
        assert got is view
        assert torch.equal(big[:, 10:60].permute(0, 2, 1, 3), want.to(dtype)) or dtype != torch.bfloat16
        assert torch.allclose(got.float(), want.float(), rtol=2 * BF16_EPS, atol=0)
        assert (big[:, :10] == 7).all() and (big[:, 60:] == 7).all()


def test_to_select_heads_and_device():
    x = clustered(B=1, H=4, S=64)
    p = quantize(x, QVGKVQuantArgs(codec="int2", centroids=16, block_size=32, asymmetric=True))
    assert p.device == torch.device("cpu")
    q = p.to("cpu", non_blocking=True)
    assert torch.equal(dequantize(q), dequantize(p))
    sub = p.select_heads(1, 3)
    assert sub.shape == (1, 2, 64, 64)
    assert torch.equal(dequantize(sub), dequantize(p)[:, 1:3])
    with pytest.raises(ValueError, match="select_heads"):
        p.select_heads(3, 3)


def test_scale_exponent_puts_the_largest_scale_at_the_top_of_e4m3():
    s = torch.tensor([1e-20, 0.013, 1.0, 448.0, 449.0, 3e5, 2.0**60], dtype=torch.float64)
    top = s * 2.0 ** -scale_exponents(s)
    assert bool(((224 < top) & (top <= 448)).all()), top
    zero_tiny = torch.tensor([0.0, 1e-40], dtype=torch.float64)
    assert scale_exponents(zero_tiny).tolist() == [0, -100]  # 2**-e stays a finite float32


def test_backend_resolution(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert resolve_backend(None, cpu) == "torch"
    assert resolve_backend("torch", cpu) == "torch"
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert resolve_backend(None, cpu) == "torch"
    monkeypatch.setenv(BACKEND_ENV, "cuda-magic")
    with pytest.raises(ValueError, match=r"one of \['auto', 'torch', 'triton'\]"):
        resolve_backend(None, cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        resolve_backend("triton", cpu)


def test_float16_and_float32_inputs():
    for dtype in (torch.float16, torch.float32):
        x = torch.randn(1, 2, 40, 64).to(dtype)
        p = quantize(x, QVGKVQuantArgs(codec="int4", centroids=16))
        assert p.dtype == dtype
        assert rel_err(dequantize(p, dtype=torch.float32), x) < 0.1
        assert math.isfinite(rel_err(dequantize(p, dtype=dtype), x))


# ---- head independence (head_offset) ------------------------------------------------------------
SPLIT_ARGS = {
    "int2-sampled": QVGKVQuantArgs(codec="int2", centroids=4, block_size=16),  # Lloyd on a sample
    "int4-mse4": QVGKVQuantArgs(codec="int4", centroids=16, block_size=16, grid="mse4"),
    "int2-mse4-2stage": QVGKVQuantArgs(codec="int2", centroids=8, block_size=16, grid="mse4", stages=2),
    "int2-asym-2stage": QVGKVQuantArgs(codec="int2", centroids=8, block_size=16, asymmetric=True,
                                       stages=2),
    "int4-asym": QVGKVQuantArgs(codec="int4", centroids=4, block_size=32, asymmetric=True),
    "int4-2stage": QVGKVQuantArgs(codec="int4", centroids=8, block_size=16, stages=2),
}
SPLITS = [[(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)], [(0, 2), (2, 5)], [(1, 4)], [(4, 5)]]


def heads_of_different_scales(B=2, H=5, S=200, D=64, seed=4) -> torch.Tensor:
    """Clustered heads whose magnitudes span 2^-6..2^6 (so per-head exponents differ), one
    all-zero head."""
    x = clustered(B=B, H=H, S=S, D=D, clusters=12, seed=seed).float()
    x *= torch.tensor([2.0**-6, 1.0, 2.0**6, 0.0, 0.37]).view(1, H, 1, 1)
    return x.to(torch.bfloat16)


def assert_same_segment(a: PackedSegment, b: PackedSegment) -> None:
    assert a.shape == b.shape and a.grid == b.grid
    assert torch.equal(a.scale_exp, b.scale_exp)
    assert _bytes(a) == _bytes(b)
    assert (a.zeros is None) == (b.zeros is None)
    if a.zeros is not None:
        assert torch.equal(a.zeros, b.zeros)


@pytest.mark.parametrize("name", list(SPLIT_ARGS))
@pytest.mark.parametrize("split", range(len(SPLITS)))
def test_packing_a_head_slice_equals_the_same_heads_of_the_whole(name, split):
    """Each head is keyed by its global index: quantizing heads [a, b) with head_offset=a
    gives the bytes (and the reconstruction) of heads [a, b) of the whole tensor."""
    args = SPLIT_ARGS[name]
    x = heads_of_different_scales()
    whole = quantize(x, args, seed=11)
    y = dequantize(whole, dtype=torch.float32)
    for a, b in SPLITS[split]:
        part = quantize(x[:, a:b], args, seed=11, head_offset=a)
        assert_same_segment(part, whole.select_heads(a, b))
        assert torch.equal(dequantize(part, dtype=torch.float32), y[:, a:b])
        assert part.nbytes == packed_nbytes_formula(tuple(x[:, a:b].shape), args)


def test_head_slice_with_a_shared_codebook_equals_the_whole():
    args = QVGKVQuantArgs(codec="int2", centroids=8, block_size=16)
    x = heads_of_different_scales()
    first = quantize(x, args, seed=3)
    x2 = heads_of_different_scales(seed=9)
    whole = quantize(x2, args, codebooks=first.centroids)
    part = quantize(x2[:, 2:4], args, codebooks=[c[:, 2:4] for c in first.centroids],
                    head_offset=2)
    assert_same_segment(part, whole.select_heads(2, 4))


def test_head_offset_keys_the_draws_and_is_validated():
    args = QVGKVQuantArgs(codec="int2", centroids=4, block_size=16)
    x = heads_of_different_scales()[:, 1:2]
    assert _bytes(quantize(x, args, head_offset=0)) != _bytes(quantize(x, args, head_offset=1))
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="head_offset must be an int >= 0"):
            quantize(x, args, head_offset=bad)


def test_scale_exponent_is_per_head():
    """A head 2^12 times larger than another leaves the small head's scale bytes unchanged
    (a segment-wide exponent would flush the small head's scales to e4m3 subnormals)."""
    args = QVGKVQuantArgs(codec="int4", centroids=8, block_size=16)
    x = heads_of_different_scales()
    p = quantize(x, args)
    alone = quantize(x[:, :1], args)
    assert torch.equal(p.scale_exp[:, 0], alone.scale_exp[:, 0])
    assert (p.scale_exp[:, 2] - p.scale_exp[:, 0] == 12).all()
    # every non-zero head's largest decoded block scale sits at the top of e4m3's range
    for h in (0, 1, 2, 4):
        top = p.scales[:, h].view(torch.uint8).masked_fill(
            p.scales[:, h].view(torch.uint8) == ZERO_BLOCK_SCALE_BYTE, 0).amax()
        assert 224 < fp8_e4m3_value(int(top)) <= 448


@pytest.mark.parametrize("name", ["int2-sampled", "int2-asym-2stage", "int4-mse4"])
def test_any_grouping_of_heads_gives_the_same_bytes(name, monkeypatch):
    """`quantize` runs groups of heads through batched kernels (a few on the CPU, all of
    them on CUDA): one head at a time and all heads at once give the same bytes."""
    from causalkv.caches.codecs.prq import quantizer

    args = SPLIT_ARGS[name]
    x = heads_of_different_scales()
    monkeypatch.setattr(quantizer, "_head_group", lambda device, n, S: 1)
    one = quantize(x, args, seed=2)
    for group in (3, 10):
        monkeypatch.setattr(quantizer, "_head_group", lambda device, n, S, g=group: min(g, n))
        assert_same_segment(quantize(x, args, seed=2), one)
        assert_same_segment(quantize(x[:, 1:4], args, seed=2, head_offset=1),
                            one.select_heads(1, 4))


def test_codec_benchmark_targets_need_fewer_bits_and_lower_error():
    """benchmarks/codec.py's peer targets: a PRQ row qualifies only with at most the peer's
    counted bits per element and a strictly lower error on the same data/tensor/bits."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "codec.py"
    spec = importlib.util.spec_from_file_location("codec_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def row(method, family, bpe, err, tensor="K", bits=2, data="structured"):
        return dict(data=data, tensor=tensor, bits=bits, method=method, family=family,
                    bits_per_element=bpe, bits_stored=bpe, rel_err=err, snr_db=0.0)

    rows = [row("hqq", "peer", 2.5, 0.40), row("prq-a", "prq", 2.6, 0.10),
            row("prq-b", "prq", 2.45, 0.30), row("prq-c", "prq", 2.4, 0.35),
            row("prq-d", "prq", 2.3, 0.05, tensor="V"), row("prq-e", "prq", 2.3, 0.01, bits=4),
            row("quanto", "peer", 2.5, 0.20, tensor="V"), row("prq-f", "prq", 2.5, 0.25, tensor="V"),
            row("prq-g", "prq", 1.0, 0.001, data="gaussian")]
    got = {(t["peer"], t["tensor"]): t for t in bench.targets(rows)}
    assert got["hqq", "K"]["prq_method"] == "prq-b" and got["hqq", "K"]["met"]
    assert got["quanto", "V"]["prq_method"] == "prq-d" and got["quanto", "V"]["met"]
    assert not bench.targets([row("hqq", "peer", 2.5, 0.1), row("prq-x", "prq", 2.4, 0.2)])[0]["met"]
    assert bench._nbytes_deep(torch.empty(3, 5, dtype=torch.bfloat16)) == 30
