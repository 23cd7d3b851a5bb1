"""The PRQ quantizer: `quantize` a K or V segment ``[B, H, S, D]`` into a `PackedSegment`, `dequantize` it.

PRQ (the Quant-VideoGen scheme), per (batch, head):

1. ``stages`` rounds of seeded k-means over the S token vectors (D dims); each round stores
   its centroids ``[B, H, K, D]`` in bf16 and one uint8 cluster id per token, and subtracts
   the assigned (bf16-rounded) centroid from the running residual.
2. The final residual is quantized per token in blocks of ``block_size`` channels to
   ``bits`` bits with one float8-e4m3 scale per block (plus an int8 zero point per block
   when ``asymmetric``), and the codes are packed ``8 // bits`` per byte.

Dequantize = sum of the assigned centroids + level x scale, in one pass per stage.

The packed form, its byte layout and its scale table are `causalkv.caches.codecs.prq.format`
(the leaf both backends import); this module is the driver: it checks the input, normalizes each
head, draws the k-means initialization, computes the block statistics and encodes the scales,
and hands the kernels to a `format.Backend`: `torch_impl` (any device) or `triton_impl`
(CUDA, when triton imports), picked by `resolve_backend`. ``args`` is any object with the
codec's settings (`format.CodecSettings`: ``bits``, ``centroids``, ``block_size``,
``stages``, ``kmeans_iters``, ``asymmetric``, ``grid``), e.g. a `QVGKVQuantArgs`; nothing
else of it is read.

Head independence: everything a head stores depends only on that head's input, the seed
and the head's *global* index (``head_offset + h``): the k-means initialization draws from a
generator keyed by (seed, batch index, global head) and the exponents are per head. So
``quantize(x[:, a:b], args, seed=s, head_offset=a)`` equals ``quantize(x, args, seed=s)``
restricted to heads ``[a, b)`` bit for bit (a rank packing its heads packs them exactly as
one process packs the same global heads).

Host syncs: on the CPU `quantize` reads the per-head absolute maxima on the host (the
non-finite check and the normalization exponents; free there). On any other device it makes
none: the exponents stay on the device, the k-means draws are computed once per geometry and
kept on the device (`kmeans_draws`), and a head whose input is not finite cannot be refused
without a sync, so it is stored *poisoned* (its scale exponent is `POISON_SCALE_EXP`) and
decodes to non-finite values, never to plausible numbers. `dequantize` makes none anywhere.
"""

from __future__ import annotations

import functools
import math

import torch

from causalkv.caches.codecs.base import CodecError, check_out, register_record
from causalkv.caches.codecs.prq import torch_impl, triton_impl
from causalkv.caches.codecs.prq.format import (
    POISON_SCALE_EXP,
    ZERO_BLOCK_SCALE_BYTE,
    Backend,
    CodecSettings,
    PackedSegment,
    encode_scales,
    scale_exponents,
)
from causalkv.caches.codecs.prq.workspace import temporary
from causalkv.env import text as env_text
from causalkv.errors import ConfigError

__all__ = ["BACKEND_ENV", "dequantize", "quantize", "resolve_backend"]

BACKEND_ENV = "CAUSALKV_QVG_BACKEND"
_BACKENDS = ("auto", "torch", "triton")
_MAX_ZERO_RANGE = 120.0  # asymmetric: |zero point| stays <= 120 + 2^(bits-1) (fits int8)
_MSE_ITERS = 4


# ---------------------------------------------------------------------------------------------
# Backend selection
# ---------------------------------------------------------------------------------------------
_triton_interpret = triton_impl.interpreting


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """``"torch"`` or ``"triton"`` for tensors on ``device``.

    ``backend`` (argument) wins, then the ``CAUSALKV_QVG_BACKEND`` env var, then auto:
    Triton for CUDA tensors when ``triton`` imports, PyTorch everywhere else.

    Raises:
        ConfigError: an unknown name, or ``"triton"`` where it cannot run.
    """
    name = (backend or env_text(BACKEND_ENV) or "auto").strip().lower()
    if name not in _BACKENDS:
        raise ConfigError(f"QVG codec backend must be one of {list(_BACKENDS)}, got {name!r}")
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_impl.AVAILABLE else "torch"
    if name == "triton":
        if not triton_impl.AVAILABLE:
            raise ConfigError(
                "QVG codec backend 'triton' requested but triton does not import; "
                "install causalkv[triton] or use backend='torch'"
            )
        if device.type != "cuda" and not triton_impl.interpreting():
            raise ConfigError(
                f"QVG codec backend 'triton' needs CUDA tensors (got {device.type}); "
                "set TRITON_INTERPRET=1 to run the kernels on the CPU, or use backend='torch'"
            )
    return name


def _impl(name: str) -> Backend:
    """The backend module `resolve_backend` named."""
    return triton_impl if name == "triton" else torch_impl


# ---------------------------------------------------------------------------------------------
# Exact power-of-two scaling (the per-head normalization)
# ---------------------------------------------------------------------------------------------
def _mul_pow2(t: torch.Tensor, e: list[int], dtype: torch.dtype) -> torch.Tensor:
    """``t [G, ...] * 2**e[g]`` as ``dtype`` (exact): one float32 multiply when every ``2**e``
    is a normal float32, else in float64 (an exponent outside float32's range)."""
    shape = (-1,) + (1,) * (t.dim() - 1)
    p = torch.tensor(e, dtype=torch.float64).exp2().view(shape)
    if -120 <= min(e) and max(e) <= 125:
        return torch.mul(t, p.to(device=t.device, dtype=torch.float32)).to(dtype)
    return (t.to(torch.float64) * p.to(t.device)).to(dtype)



# ---------------------------------------------------------------------------------------------
# Block statistics (shared; plain torch on any device)
# ---------------------------------------------------------------------------------------------
def _block_scales(
    r: torch.Tensor, bits: int, block: int, grid: str, asymmetric: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Raw fp32 block scales ``[N, nb]`` for residual ``r [N, D]`` (and block minima if asym)."""
    N, D = r.shape
    r3 = r.view(N, D // block, block)
    if asymmetric or grid == "reference":
        mn, mx = r3.amin(-1), r3.amax(-1)  # two vectorized reads, no temporary
        amax = torch.maximum(mn.abs(), mx.abs())  # abs: +0.0 for an all-zero block
        if asymmetric:
            s = torch.maximum((mx - mn) / float(2**bits - 1), amax / _MAX_ZERO_RANGE)
            return s, mn
        return amax / float(2 ** (bits - 1) - 1), None
    amax = r3.abs().amax(-1)
    # "mse4": levels (2v+1)*s over all 2^bits codes; alternate nearest-level assignment and
    # the least-squares scale (each step lowers the block's squared error), starting from the
    # grid whose outer level is the block's absmax.
    half = 2 ** (bits - 1)
    s = amax / float(2**bits - 1)
    lv = temporary("scales.lv", r3.numel(), torch.float32, r.device).view(r3.shape)
    for _ in range(_MSE_ITERS):
        safe = torch.where(s > 0, s, 1.0).unsqueeze(-1)
        torch.div(r3, safe, out=lv)
        lv.mul_(0.5).floor_().clamp_(-half, half - 1).mul_(2.0).add_(1.0)
        s = torch.linalg.vecdot(r3, lv) / torch.linalg.vecdot(lv, lv)
    return s, None


# ---------------------------------------------------------------------------------------------
# quantize / dequantize
# ---------------------------------------------------------------------------------------------
def _check_args(args: CodecSettings, D: int) -> None:
    """The codec's own limits on ``args`` for head_dim ``D`` (a `QVGKVQuantArgs` checked its
    ranges on construction; any other settings object is checked here)."""
    if args.bits is None:
        raise CodecError(
            "quantize: args.bits is None (quantization off, or not a PRQ setting); pass "
            "QVGKVQuantArgs(codec=\"int2\") or codec=\"int4\""
        )
    if args.bits not in (2, 4):
        raise CodecError(f"quantize: bits must be 2 or 4, got {args.bits!r}")
    for name in ("centroids", "block_size", "stages", "kmeans_iters"):
        value = getattr(args, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise CodecError(f"quantize: {name} must be a positive int, got {value!r}")
    if args.centroids > 256:
        raise CodecError(
            f"quantize: centroids must be <= 256 (cluster ids are uint8), got {args.centroids}"
        )
    if args.grid not in ("reference", "mse4"):
        raise CodecError(f"quantize: grid must be 'reference' or 'mse4', got {args.grid!r}")
    if D % args.block_size:
        raise CodecError(
            f"quantize: head_dim {D} is not divisible by block_size {args.block_size}; "
            f"choose a block size that divides {D}"
        )
    if (args.block_size * args.bits) % 8:
        raise CodecError(
            f"quantize: block_size {args.block_size} x {args.bits} bits is not a whole number "
            f"of bytes; use a block size divisible by {8 // args.bits}"
        )


def head_seed(seed: int, b: int, head: int) -> int:
    """The k-means generator seed of batch ``b``, *global* head ``head`` (splitmix64 mix)."""
    z = (int(seed) * 0x9E3779B97F4A7C15 + b * 0xBF58476D1CE4E5B9 + head * 0x94D049BB133111EB
         + 0x632BE59BD9B4E019) & _MASK64
    for mul, shift in ((0xBF58476D1CE4E5B9, 30), (0x94D049BB133111EB, 27)):
        z = ((z ^ (z >> shift)) * mul) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


_MASK64 = (1 << 64) - 1


def kmeans_sample_size(S: int, K: int) -> int:
    """Tokens per head the Lloyd iterations run on: all ``S`` up to ``SAMPLE_PER_CENTROID * K``.

    Above that, a seeded random subset (the final assignment always covers every token).
    """
    return min(S, max(K, SAMPLE_PER_CENTROID * K))


SAMPLE_PER_CENTROID = 32


def _draws(
    seed: int, heads: list[tuple[int, int]], S: int, K: int, m: int, stages: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per stage: (initial centroid tokens ``[G, K]``, Lloyd sample tokens ``[G, m]`` sorted)
    for the heads ``[(b, global_head), ...]``: one seeded permutation per head and stage."""
    gens = [torch.Generator().manual_seed(head_seed(seed, b, h)) for b, h in heads]
    out = []
    for _ in range(stages):
        perms = torch.stack([torch.randperm(S, generator=g) for g in gens])  # [G, S]
        sample = perms[:, :m].sort(dim=1).values if m < S else perms[:, :0]
        out.append((perms[:, :K], sample))
    return out


@functools.lru_cache(maxsize=64)
def kmeans_draws(
    seed: int, heads: tuple[tuple[int, int], ...], S: int, K: int, m: int, stages: int,
    device: str,
) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """`_draws` for these heads and this geometry, on ``device``: computed on the host once,
    then reused (a stream packs chunks of one size with the same heads, layer after layer),
    so a quantize on a GPU draws nothing on the host and copies nothing to the device.
    The tensors are shared: callers only read them."""
    return tuple(
        (pick.to(device), sample.to(device))
        for pick, sample in _draws(seed, list(heads), S, K, m, stages)
    )


def _pow2_bits(e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Exactly ``2.0**e`` as ``dtype`` (float32 or float64) for int ``e`` in its normal range,
    built from the exponent bits (no host value, no rounding)."""
    if dtype == torch.float64:
        return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def _mul_pow2_device(
    t: torch.Tensor, e: torch.Tensor, dtype: torch.dtype, work: torch.dtype
) -> torch.Tensor:
    """``t [G, ...] * 2**e[g]`` as ``dtype``, computed in ``work`` (float32 or float64), with
    ``e [G]`` an int tensor on ``t``'s device (no host sync): two multiplies by normal powers
    of two of ``work`` (exact unless a value lands in the subnormal range, like `_mul_pow2`;
    ``e`` beyond twice the range saturates to 0 or inf, as the exact product would in
    ``dtype``). Callers pick float64 where ``e`` may exceed float32's doubled range (float64
    inputs, the centroids of any head)."""
    shape = (-1,) + (1,) * (t.dim() - 1)
    lo, hi = (-1022, 1023) if work == torch.float64 else (-126, 127)
    a = e.clamp(lo, hi)
    out = t.to(work) * _pow2_bits(a, work).view(shape)
    out.mul_(_pow2_bits((e - a).clamp(lo, hi), work).view(shape))  # 2**0 unless outside
    return out.to(dtype)


def _host_checked(device: torch.device) -> bool:
    """True when `quantize` reads the per-head maxima on the host (the CPU: no sync to pay)."""
    return device.type == "cpu"


def _rows(c: torch.Tensor, ids: torch.Tensor, buf: str | None = None) -> torch.Tensor:
    """``c [G, K, D]`` rows picked by ``ids [G, S]`` -> ``[G, S, D]`` (one row gather; into
    the reused workspace buffer ``buf`` if named)."""
    G, K, D = c.shape
    S = ids.shape[1]
    out = None if buf is None else temporary(buf, G * S * D, c.dtype, c.device).view(G * S, D)
    if G == 1:
        return torch.index_select(c[0], 0, ids[0], out=out).view(1, S, D)
    off = torch.arange(G, device=ids.device, dtype=ids.dtype).unsqueeze(1) * K
    flat = (ids + off).reshape(-1)
    return torch.index_select(c.reshape(G * K, D), 0, flat, out=out).view(G, S, D)


_CPU_GROUP_ROWS = 1 << 15


def _head_group(device: torch.device, BH: int, S: int) -> int:
    """Heads per batch of kernels in `quantize`: on the CPU about ``2^15`` tokens' worth
    (cache-sized temporaries, few enough ops), elsewhere all of them."""
    return max(1, min(BH, _CPU_GROUP_ROWS // S)) if device.type == "cpu" else BH


@torch.compiler.disable(reason="packing must give eager's codes bit for bit; one break")
def quantize(
    x: torch.Tensor,
    args: CodecSettings,
    *,
    seed: int = 1234,
    backend: str | None = None,
    codebooks: list[torch.Tensor] | None = None,
    head_offset: int = 0,
) -> PackedSegment:
    """PRQ-pack ``x [B, H, S, D]`` (any float dtype, any strides) with ``args``.

    Deterministic: the same input, args, seed and backend give identical bytes; the global
    RNG is untouched (the k-means initialization draws from private seeded generators).

    ``head_offset`` is the global index of ``x``'s first head (e.g. ``rank * H`` when each
    rank holds ``H`` heads): each head's k-means draws are keyed by (seed, batch index,
    ``head_offset + h``) and every stored exponent is per head, so
    ``quantize(x[:, a:b], args, seed=s, head_offset=a)`` equals
    ``quantize(x, args, seed=s).select_heads(a, b)`` bit for bit.

    ``codebooks`` (one ``[B, H, K, D]`` bf16 tensor per stage, e.g. ``other.centroids`` of
    an earlier segment) skips k-means: tokens are assigned to those centroids and the
    returned segment references the very same tensors, so segments sharing a codebook
    store it once (the cache counts shared tensors once).

    Raises:
        CodecError (a ValueError): quantization off, bad shape, ``D % block_size != 0``,
            more than 256 centroids, a negative ``head_offset``, or (on the CPU) NaN/inf in
            ``x`` (the message says how many). On other devices no host sync is made: a head with
            NaN/inf is stored poisoned (see the module docstring).
    """
    if x.dim() != 4:
        raise CodecError(f"quantize: expected x of shape [B, H, S, D], got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise CodecError(f"quantize: expected a floating-point tensor, got {x.dtype}")
    if not isinstance(head_offset, int) or head_offset < 0:
        raise CodecError(
            f"quantize: head_offset must be an int >= 0 (global index of x's first head), "
            f"got {head_offset!r}"
        )
    B, H, S, D = (int(v) for v in x.shape)
    _check_args(args, D)
    if codebooks is not None:
        if len(codebooks) != args.stages or any(
            c.dim() != 4 or tuple(c.shape[:2]) != (B, H) or c.shape[3] != D
            or c.dtype != torch.bfloat16 for c in codebooks
        ):
            raise CodecError(
                f"quantize: codebooks must be {args.stages} bf16 tensor(s) of shape "
                f"[{B}, {H}, K, {D}], got {[(tuple(c.shape), c.dtype) for c in codebooks]}"
            )
    if B * H * S == 0:
        raise CodecError(f"quantize: empty segment {tuple(x.shape)}; nothing to pack")
    # Per-head absolute maxima: NaN/inf propagate, so one read covers the non-finite check
    # and the per-head normalization exponents.
    head_amax = torch.maximum(x.amax(dim=(2, 3)), x.amin(dim=(2, 3)).neg())
    impl = _impl(resolve_backend(backend, x.device))
    assert args.bits is not None
    BH, nb = B * H, D // args.block_size
    K = min(args.centroids, S) if codebooks is None else int(codebooks[0].shape[2])
    # Normalize each head by a power of two (exact) so |x| <= 1: k-means distances cannot
    # overflow fp32 for any bf16-range input, and the codec is exactly equivariant to 2^k.
    poisoned: torch.Tensor | None = None
    norm: list[int] | torch.Tensor
    if _host_checked(x.device):
        amaxes = head_amax.reshape(-1).tolist()
        if not all(math.isfinite(a) for a in amaxes):
            bad = int((~torch.isfinite(x)).sum())
            raise CodecError(
                f"quantize: input has {bad} non-finite value(s) (NaN or inf) out of "
                f"{x.numel()}; PRQ needs finite K/V"
            )
        norm = [math.frexp(a)[1] if a > 0 else 0 for a in amaxes]
    else:  # the same exponents, on the device (frexp is exact in any float dtype)
        flat_amax = head_amax.reshape(-1)
        poisoned = ~torch.isfinite(flat_amax)
        norm = torch.where((flat_amax > 0) & ~poisoned, torch.frexp(flat_amax)[1], 0)
    dev = x.device
    codes = torch.empty(B, H, S, D * args.bits // 8, dtype=torch.uint8, device=dev)
    scales = torch.empty(B, H, S, nb, dtype=torch.uint8, device=dev)
    zeros = torch.empty(B, H, S, nb, dtype=torch.int8, device=dev) if args.asymmetric else None
    exps = torch.empty(B, H, dtype=torch.int16, device=dev)
    ids = [torch.empty(B, H, S, dtype=torch.uint8, device=dev) for _ in range(args.stages)]
    cents = (list(codebooks) if codebooks is not None else
             [torch.empty(B, H, K, D, dtype=torch.bfloat16, device=dev) for _ in range(args.stages)])
    # Groups of heads (every operation is per head, so the grouping does not change a bit).
    group = _head_group(dev, BH, S)
    for g0 in range(0, BH, group):
        g1 = min(g0 + group, BH)
        xg = (x[g0 // H, g0 % H].unsqueeze(0) if group == 1 else
              torch.stack([x[i // H, i % H] for i in range(g0, g1)]) if B > 1 else x[0, g0:g1])
        out = _quantize_heads(
            xg, norm[g0:g1], args, impl, seed=seed,
            heads=[(i // H, head_offset + i % H) for i in range(g0, g1)],
            codebooks=None if codebooks is None else [
                c.reshape(BH, K, D)[g0:g1] for c in codebooks],
            poisoned=None if poisoned is None else poisoned[g0:g1],
        )
        codes.view(BH, S, -1)[g0:g1] = out[0]
        scales.view(BH, S, nb)[g0:g1] = out[1]
        exps.view(BH)[g0:g1] = out[2]
        if zeros is not None:
            zeros.view(BH, S, nb)[g0:g1] = out[3]
        for st in range(args.stages):
            ids[st].view(BH, S)[g0:g1] = out[4][st]
            if codebooks is None:
                cents[st].view(BH, K, D)[g0:g1] = out[5][st]
    if poisoned is not None:
        exps.view(BH).masked_fill_(poisoned, POISON_SCALE_EXP)
    return PackedSegment(
        centroids=cents,
        ids=ids,
        codes=codes,
        scales=scales.view(torch.float8_e4m3fn),
        zeros=zeros,
        scale_exp=exps,
        shape=(B, H, S, D),
        dtype=x.dtype,
        bits=args.bits,
        block_size=args.block_size,
        grid="reference" if args.asymmetric else args.grid,
    )


# also here: torch.compile(quantize) compiles the undecorated function under the entry's
# decoration, and k-means and the block scales must still run eagerly
@torch.compiler.disable(reason="k-means and the block scales must give eager's codes bit for bit")
def _quantize_heads(
    xg: torch.Tensor,
    norm: list[int] | torch.Tensor,
    args: CodecSettings,
    impl,
    *,
    seed: int,
    heads: list[tuple[int, int]],
    codebooks: list[torch.Tensor] | None,
    poisoned: torch.Tensor | None = None,
):
    """PRQ of ``G`` heads ``xg [G, S, D]``; ``norm[g]``: head ``g``'s normalization exponent
    (a host list on the CPU, an int tensor on the device elsewhere: then nothing here reads a
    device value on the host), ``heads[g]``: its (batch index, global head index);
    ``poisoned [G]`` (device path): heads whose input is not finite, packed as zeros (their
    exponent is poisoned afterwards).

    Returns (codes ``[G, S, D*bits/8]`` uint8, scale bytes ``[G, S, nb]`` uint8, exponents
    ``[G]`` int16, zeros ``[G, S, nb]`` int8 or None, ids per stage ``[G, S]`` uint8, bf16
    centroids per stage ``[G, K, D]``). Every operation is per head (batched GEMMs, row-wise
    reductions, row gathers), so a head's result does not depend on the others.
    """
    G, S, D = xg.shape
    bits, block, grid = args.bits, args.block_size, args.grid
    assert bits is not None
    nb = D // block
    dev = xg.device
    host = isinstance(norm, list)
    if host:
        neg = [-e for e in norm]
        if -120 <= min(neg) and max(neg) <= 125:  # |xf| <= 1: cast, then scale in place (exact)
            xf = temporary("quantize.x", G * S * D, torch.float32, dev).view(G, S, D).copy_(xg)
            if any(neg):
                xf.mul_(torch.tensor(neg, dtype=torch.float64).exp2().float().to(dev).view(G, 1, 1))
        else:
            xf = _mul_pow2(xg, neg, torch.float32).contiguous()
    else:
        neg_t = -norm
        # float32 work covers +-254: every exponent of a float32/bf16/fp16 input's head
        work = torch.float64 if xg.dtype == torch.float64 else torch.float32
        xf = _mul_pow2_device(xg, neg_t, torch.float32, work).contiguous()
        if poisoned is not None:  # NaN/inf would only derail k-means: pack zeros instead
            xf.masked_fill_(poisoned.view(G, 1, 1), 0.0)

    def scaled(t: torch.Tensor, e_neg: bool, dtype: torch.dtype) -> torch.Tensor:
        """``t * 2**-norm`` (``e_neg``) or ``t * 2**norm`` per head, as ``dtype``."""
        if host:
            return _mul_pow2(t, neg if e_neg else list(norm), dtype)
        return _mul_pow2_device(t, neg_t if e_neg else norm, dtype, torch.float64)
    x3 = xf.view(G * S, nb, block)
    zero_block = (x3.amax(-1) == 0) & (x3.amin(-1) == 0)  # [G*S, nb]: all-zero input block
    resid = xf  # updated in place from here on
    ids, cents = [], []
    if codebooks is None:
        K = min(args.centroids, S)
        draws = kmeans_draws(seed, tuple(heads), S, K, kmeans_sample_size(S, K), args.stages,
                             str(dev))
    for stage in range(args.stages):
        if codebooks is not None:
            c32 = scaled(codebooks[stage], True, torch.float32)
        else:
            pick, sample = draws[stage]
            c = _rows(resid, pick)
            xs = _rows(resid, sample, "quantize.sample") if sample.shape[1] else resid
            for _ in range(args.kmeans_iters):
                a = impl.kmeans_assign(xs, c)
                c = impl.kmeans_update(xs, a, c)
            c_bf = c.to(torch.bfloat16)
            c32 = c_bf.float()
            cents.append(scaled(c_bf, False, torch.bfloat16))
        a = impl.kmeans_assign(resid, c32)
        resid.sub_(_rows(c32, a, "quantize.rows"))
        ids.append(a.to(torch.uint8))

    r = resid.view(G * S, D)
    raw, bmin = _block_scales(r, bits, block, grid, args.asymmetric)
    exp = scale_exponents(raw.view(G, S * nb).amax(dim=1))  # [G] int32
    enc, dec = encode_scales(raw.view(G, S, nb), exp.view(G, 1, 1),
                             round_up=grid != "mse4" or args.asymmetric)
    enc, dec = enc.view(G * S, nb), dec.view(G * S, nb)
    enc.masked_fill_(zero_block, ZERO_BLOCK_SCALE_BYTE)
    dec.masked_fill_(zero_block, 0.0)
    zeros = None
    if args.asymmetric:
        assert bmin is not None
        safe = torch.where(dec > 0, dec, 1.0)
        z = torch.floor(-bmin / safe + 0.5) - 2 ** (bits - 1)
        zeros = torch.where(dec > 0, z, 0.0).to(torch.int8)
    packed = impl.quantize_pack(r, dec, zeros, bits=bits, block=block, grid=grid)
    n = torch.tensor(norm, dtype=torch.int32, device=dev) if host else norm.to(torch.int32)
    return (
        packed.view(G, S, -1),
        enc.view(G, S, nb),
        (exp + n).to(torch.int16),
        None if zeros is None else zeros.view(G, S, nb),
        ids,
        cents,
    )


def dequantize(
    packed: PackedSegment,
    *,
    dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Reconstruct ``[B, H, S, D]`` from ``packed``.

    With ``out`` (any strides, e.g. ``big.permute(0, 2, 1, 3)[:, :, a:b]`` of a ``[B, S, H, D]``
    buffer, on ``packed.device``) the result is written into it in ``out.dtype`` and ``out``
    is returned; otherwise a new contiguous tensor of ``dtype`` is returned.
    """
    shape = tuple(packed.shape)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=packed.device)
    else:
        check_out("dequantize", packed, out)
    if out.numel() == 0:
        return out
    impl = _impl(resolve_backend(backend, packed.device))
    impl.dequantize_into(packed, out)
    return out


def _dequantize_into(packed: PackedSegment, out: torch.Tensor) -> None:
    dequantize(packed, out=out)


# a PackedSegment is read through the codec seam: decoded here, attended by the Triton kernel
register_record(PackedSegment, decode_into=_dequantize_into,
                attention_module="causalkv.caches.codecs.prq.attention")
