"""The codec seam: FP8 and NVFP4 against float64 references written from the formats'
definitions, exact byte formulas, the record interface, and the registry."""

from __future__ import annotations

import math

import pytest
import torch

from causalkv.caches.codecs import codec_names, codec_setting, make_codec, register_codec
from causalkv.caches.codecs.base import CodecError, decode_record
from causalkv.caches.codecs.fp8 import FP8Codec
from causalkv.caches.codecs.nvfp4 import E2M1, NVFP4Codec
from causalkv.caches.codecs.prq import quantizer as prq
from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.errors import ConfigError


def _x(shape=(2, 3, 40, 64), seed=0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.logspace(-2, 1, shape[-1]).reshape(1, 1, 1, -1)
    return x.to(dtype)


# ---- float64 references, from the definitions ------------------------------------------------
def e4m3_round(v: torch.Tensor) -> torch.Tensor:
    """Round float64 ``v`` (|v| <= 448) to e4m3: 3 mantissa bits, exponent >= -6, subnormal
    step 2**-9, ties to even."""
    a = v.abs()
    exp = torch.floor(torch.log2(torch.where(a > 0, a, 1.0))).clamp(min=-6)
    step = torch.exp2(exp - 3)
    q = a / step
    r = torch.floor(q)
    frac = q - r
    r = torch.where(frac > 0.5, r + 1, torch.where(frac < 0.5, r, r + (r % 2)))
    return torch.sign(v) * r * step


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """Nearest of ±{0, 0.5, 1, 1.5, 2, 3, 4, 6} (saturating at 6), ties to the even index."""
    grid = torch.tensor(E2M1, dtype=torch.float64)
    a = v.abs().clamp(max=6.0)
    d = (a.unsqueeze(-1) - grid).abs()
    best = d.min(-1, keepdim=True).values
    cand = (d == best)
    idx = torch.where(cand.sum(-1) > 1, cand.float().argmax(-1) + (cand.float().argmax(-1) % 2),
                      d.argmin(-1))
    return torch.sign(v) * grid[idx]


def fp8_reference(x: torch.Tensor, block: int | None) -> torch.Tensor:
    B, H, S, D = x.shape
    G = 1 if block is None else D // block
    xg = x.double().reshape(B, H, S, G, D // G)
    scale = (xg.abs().amax(-1, keepdim=True).float() / 448.0).double()  # stored in fp32
    v = torch.where(scale > 0, xg / torch.where(scale > 0, scale, 1.0), 0.0)
    return (e4m3_round(v) * scale).reshape(B, H, S, D)


def nvfp4_reference(x: torch.Tensor) -> torch.Tensor:
    B, H, S, D = x.shape
    xb = x.double().reshape(B, H, S, D // 16, 16)
    g = float(torch.tensor(float(xb.abs().max()) / (448.0 * 6.0), dtype=torch.float32))
    if g == 0:
        return torch.zeros_like(x, dtype=torch.float64)
    bmax = xb.abs().amax(-1, keepdim=True)
    s = e4m3_round((bmax / (6.0 * g)).clamp(max=448.0)) * g
    v = torch.where(s > 0, xb / torch.where(s > 0, s, 1.0), 0.0)
    return (e2m1_round(v) * s).reshape(B, H, S, D)


def _same(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Fraction of elements equal up to one float32 rounding of the decoded product."""
    return float(((got - ref).abs() <= 2.0 ** -23 * ref.abs()).double().mean())


# ---- FP8 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", [None, 32])
def test_fp8_matches_its_float64_reference_and_its_bound(block):
    x = _x()
    c = FP8Codec(block)
    rec = c.encode(x)
    got = c.decode(rec, torch.float64)
    ref = fp8_reference(x, block)
    # the same element up to the float32 product almost everywhere (float32 vs float64
    # division can flip a tie)
    assert _same(got, ref) > 0.999
    B, H, S, D = x.shape
    G = 1 if block is None else D // block
    scale = (x.abs().reshape(B, H, S, G, D // G).amax(-1, keepdim=True) / 448.0).expand(
        B, H, S, G, D // G).reshape(x.shape).double()
    bound = (2.0 ** -4 * x.double().abs() + 2.0 ** -10 * scale) * (1 + 2.0 ** -20)
    assert ((got - x.double()).abs() <= bound).all()
    assert rec.nbytes == c.nbytes(tuple(x.shape)) == B * H * S * D + 4 * B * H * S * G


def test_fp8_exact_on_e4m3_values_and_zero_groups():
    x = torch.zeros(1, 1, 3, 8)
    x[0, 0, 0] = torch.tensor([448.0, -1.5, 0.25, 2.0 ** -9, 0, 3.5, -448.0, 7.0])
    c = FP8Codec()
    got = c.decode(c.encode(x), torch.float32)
    assert torch.equal(got, x)  # scale 1: every value is an e4m3 value


@pytest.mark.parametrize("block", [0, -8, 2.0, True])
def test_fp8_block_must_be_a_positive_int(block) -> None:
    with pytest.raises(CodecError, match=f"fp8 block must be a positive int or None, got {block!r}"):
        FP8Codec(block)


# ---- NVFP4 -----------------------------------------------------------------------------------
def test_nvfp4_matches_its_float64_reference_and_its_bound():
    x = _x(seed=1)
    c = NVFP4Codec()
    rec = c.encode(x)
    got = c.decode(rec, torch.float64)
    ref = nvfp4_reference(x)
    assert _same(got, ref) > 0.999
    xb = x.double().abs().reshape(*x.shape[:3], -1, 16)
    bmax = xb.amax(-1, keepdim=True).expand_as(xb).reshape(x.shape)
    amax = float(x.abs().max())
    bound = torch.where(bmax >= amax / 28672, bmax / 4, torch.full_like(bmax, amax / 14336))
    assert ((got - x.double()).abs() <= bound * (1 + 2.0 ** -20)).all()
    B, H, S, D = x.shape
    assert rec.nbytes == c.nbytes(tuple(x.shape)) == B * H * S * D // 2 + B * H * S * D // 16 + 4


def test_nvfp4_grid_and_ties():
    # global amax 6 * 448 * g with g = 1: one block scale 448 / 448... built so s = 1 exactly
    x = torch.zeros(1, 1, 1, 32)
    x[0, 0, 0, :16] = torch.tensor([6.0, -4, 3, -2, 1.5, -1, 0.5, 0, 0.25, 0.75, 1.25, 1.75, 2.5,
                                    3.5, 5.0, -5.0])
    c = NVFP4Codec()
    got = c.decode(c.encode(x), torch.float64)[0, 0, 0, :16]
    g = 6.0 / (448 * 6)
    s = float(e4m3_round(torch.tensor(6.0 / (6 * g), dtype=torch.float64))) * g
    want = e2m1_round(x[0, 0, 0, :16].double() / s) * s
    assert torch.equal(got, want)
    # ties to the even index: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    assert torch.equal(e2m1_round(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0],
                                               dtype=torch.float64)),
                       torch.tensor([0, 1, 1, 2, 2, 4, 4, -4], dtype=torch.float64))
    assert torch.equal(c.decode(c.encode(torch.zeros(1, 1, 2, 16)), torch.float32),
                       torch.zeros(1, 1, 2, 16))


# ---- the record interface, for every codec -------------------------------------------------------
@pytest.mark.parametrize("name", ["int4", "int2", "fp8", "nvfp4"])
def test_records_slice_move_and_decode_into_a_given_buffer(name):
    q = QVGKVQuantArgs(codec=name, centroids=8, block_size=16)
    c = make_codec(name, q)
    x = _x((1, 4, 30, 32), seed=2)
    rec = c.encode(x)
    assert rec.nbytes == c.nbytes(tuple(x.shape))
    full = c.decode(rec, torch.float32)
    part = rec.select_heads(1, 3).select_tokens(5, 20)
    buf = torch.full((1, 20, 4, 32), float("nan"))  # [B, S, H, D] like the store's buffers
    c.decode_into(part, buf.permute(0, 2, 1, 3)[:, 1:3, 5:20])
    assert torch.equal(buf.permute(0, 2, 1, 3)[:, 1:3, 5:20], full[:, 1:3, 5:20])
    assert torch.equal(decode_record(part.to("cpu"), torch.float32), full[:, 1:3, 5:20])
    with pytest.raises(CodecError):
        c.decode_into(part, torch.empty(1, 2, 14, 32))


@pytest.mark.parametrize("name", ["fp8", "nvfp4"])
def test_non_finite_input_is_refused_on_the_cpu(name):
    x = _x((1, 1, 4, 16))
    x[0, 0, 2, 3] = float("nan")
    with pytest.raises(CodecError, match="1 NaN/inf"):
        make_codec(name, QVGKVQuantArgs(codec=name)).encode(x)


def test_prq_behind_the_interface_is_the_qvg_codec_bit_for_bit():
    q = QVGKVQuantArgs(codec="int2", centroids=8, block_size=16)
    x = _x((1, 2, 48, 32), seed=3).bfloat16()
    a = make_codec("int2", q).encode(x, seed=7, head_offset=2)
    b = prq.quantize(x, q, seed=7, head_offset=2)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales.view(torch.uint8),
                                                         b.scales.view(torch.uint8))
    assert make_codec("int2", q).nbytes((1, 2, 48, 32)) == a.nbytes


def test_bits_per_element_at_longlive2_geometry():
    """S = 7,040 tokens (one 8-frame chunk), D = 128."""
    q = QVGKVQuantArgs(codec="int2")
    assert make_codec("fp8", q).bits_per_element(7040, 128) == 8.25
    assert math.isclose(make_codec("nvfp4", q).bits_per_element(7040, 128), 4.5 + 32 / (7040 * 128))


# ---- the registry ------------------------------------------------------------------------------
def test_registry_is_lazy_and_refuses_clashes():
    assert codec_names()[:4] == ("int4", "int2", "fp8", "nvfp4")
    assert codec_setting("int4").params == {"bits": 4}
    register_codec("int4", "causalkv.caches.codecs.prq.codec:PRQCodec", bits=4)  # same: a no-op
    with pytest.raises(ConfigError, match="registered twice"):
        register_codec("int4", "causalkv.caches.codecs.fp8:FP8Codec")
    with pytest.raises(ConfigError, match="reserved"):
        register_codec("off", "x:Y")
    with pytest.raises(ConfigError, match="unknown KV codec 'fp6'"):
        codec_setting("fp6")


def test_a_codec_is_named_for_the_setting_it_was_made_from():
    """A setting a plugin registers over a built-in class (fp8 with a scale per 4 channels)
    names itself, not the class's default, in what it refuses."""
    from causalkv.caches.codecs import unregister_codec

    register_codec("fp8-b4", "causalkv.caches.codecs.fp8:FP8Codec", block=4)
    try:
        codec = make_codec("fp8-b4", QVGKVQuantArgs(codec="fp8-b4"))
        assert (codec.name, codec.block, FP8Codec().name) == ("fp8-b4", 4, "fp8")
        with pytest.raises(CodecError, match=r"^fp8-b4 encode: expected x of shape \[B, H, S, D\]"):
            codec.encode(torch.zeros(2, 8))
    finally:
        unregister_codec("fp8-b4")


# ---- any codec in the cache, on any tier --------------------------------------------------------
@pytest.mark.parametrize(("main", "tier"), [("fp8", "bf16"), ("nvfp4", "fp8"), ("int2", "nvfp4")])
def test_the_cache_packs_with_any_codec_on_any_tier(main, tier):
    """A window of 4 chunks, keep-recent 1: chunk 5 is the recent one (at ``tier``), 3 and 4
    cold (at ``main``, re-packed from the tier), 6 current; each packed chunk reads back as its
    codecs' round trips of what was written, and the resident bytes are the codecs' formulas."""
    from causalkv.caches import CausalCacheSpec, attention
    from causalkv.caches.qvg.packed import QVGPackedCausalKVCache
    from causalkv.caches.qvg.segments import PackedKV

    n, H, D = 32, 2, 32
    spec = CausalCacheSpec(batch_size=1, num_heads=H, head_dim=D, cache_size=4 * n, sink_tokens=0,
                       global_sink_tokens=0, dtype=torch.bfloat16)
    prq = dict(centroids=4, block_size=16) if "int2" in (main, tier) else {}  # PRQ's own knobs
    q = QVGKVQuantArgs(codec=main, recent_tier=tier, **prq)
    cache = QVGPackedCausalKVCache(spec, q)

    def chunk(i):
        g = torch.Generator().manual_seed(i)
        return (torch.randn(1, n, H, D, generator=g).bfloat16(),
                torch.randn(1, n, H, D, generator=g).bfloat16())

    for i in range(7):
        k, v = chunk(i)
        view = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=i * n)
    tiers = {s.start // n: (s.storage.codec.name if isinstance(s.storage, PackedKV) else "bf16")
             for s in cache.segments}
    assert tiers == {3: main, 4: main, 5: tier, 6: "bf16"}
    expect = 0
    for s in cache.segments:
        if isinstance(s.storage, PackedKV):
            c = s.storage.codec
            assert s.storage.nbytes == 2 * c.nbytes((1, H, s.end - s.start, D))
            k = chunk(s.start // n)[0].permute(0, 2, 1, 3)
            if tier != "bf16" and c.name == main:  # held at the tier first, re-packed from it
                t = make_codec(tier, q)
                k = t.decode(t.encode(k, seed=1234), torch.bfloat16)
            want = c.decode(c.encode(k, seed=1234), torch.bfloat16)
            got = s.storage.decoded(torch.device("cpu"), torch.bfloat16).k.permute(0, 2, 1, 3)
            assert torch.equal(got, want)
        expect += s.nbytes
    assert cache.resident_nbytes() == expect
    query = torch.randn(1, n, H, D).bfloat16()
    out = attention.attend(query, view, fused=False)
    ref = attention.attend_dense(query.float(), view.k.float(), view.v.float())
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
