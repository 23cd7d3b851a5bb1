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
and hands the kernels to a `format.PRQKernels`: `torch_impl` (any device) or `triton_impl`
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

import torch

from causalkv.caches.codecs.base import CodecError, check_out, check_segment, register_record
from causalkv.caches.codecs.prq import torch_impl, triton_impl
from causalkv.caches.codecs.prq.format import (
    POISON_SCALE_EXP,
    ZERO_BLOCK_SCALE_BYTE,
    CodecSettings,
    PackedSegment,
    PRQKernels,
    block_fills_bytes,
    encode_scales,
    pow2,
    scale_exponents,
)
from causalkv.caches.codecs.prq.workspace import temporary
from causalkv.env import text as env_text
from causalkv.errors import ConfigError, int_requirement, is_int

__all__ = ["BACKEND_ENV", "dequantize", "quantize", "resolve_backend"]

BACKEND_ENV = "CAUSALKV_QVG_BACKEND"
_BACKENDS = ("auto", "torch", "triton")
_MAX_ZERO_RANGE = 120.0  # asymmetric: |zero point| stays <= 120 + 2^(bits-1) (fits int8)
_MSE_ITERS = 4


# ---------------------------------------------------------------------------------------------
# Backend selection
# ---------------------------------------------------------------------------------------------
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


#: the backend module `resolve_backend` names
_IMPLS: dict[str, PRQKernels] = {"torch": torch_impl, "triton": triton_impl}


# ---------------------------------------------------------------------------------------------
# Block statistics (shared; plain torch on any device)
# ---------------------------------------------------------------------------------------------
def _block_scales(
    r: torch.Tensor, bits: int, block: int, grid: str, asymmetric: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Raw fp32 block scales ``[N, nb]`` for residual ``r [N, D]`` (and block minima if asym)."""
    r3 = r.unflatten(-1, (-1, block))  # [N, nb, block]
    if asymmetric or grid == "reference":
        mn, mx = r3.amin(-1), r3.amax(-1)  # two vectorized reads, no temporary
        amax = torch.maximum(mn.abs(), mx.abs())  # abs: +0.0 for an all-zero block
        if asymmetric:
            return torch.maximum((mx - mn) / float(2**bits - 1), amax / _MAX_ZERO_RANGE), mn
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
    if args.bits not in (2, 4):
        raise CodecError(f"quantize: bits must be 2 or 4 (codec int2 or int4; None is "
                         f"quantization off), got {args.bits!r}")
    for name in ("centroids", "block_size", "stages", "kmeans_iters"):
        if not is_int(value := getattr(args, name), 1):
            raise CodecError(f"quantize: {name} {int_requirement(1)}, got {value!r}")
    if args.centroids > 256:
        raise CodecError(f"quantize: centroids must be <= 256 (cluster ids are uint8), "
                         f"got {args.centroids}")
    if args.grid not in ("reference", "mse4"):
        raise CodecError(f"quantize: grid must be 'reference' or 'mse4', got {args.grid!r}")
    if D % args.block_size:
        raise CodecError(f"quantize: head_dim {D} is not divisible by block_size "
                         f"{args.block_size}; choose a block size that divides {D}")
    if not block_fills_bytes(args.block_size, args.bits):
        raise CodecError(f"quantize: block_size {args.block_size} x {args.bits} bits is not a "
                         f"whole number of bytes; use a block size divisible by {8 // args.bits}")


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


@functools.lru_cache(maxsize=64)
def kmeans_draws(
    seed: int, heads: tuple[tuple[int, int], ...], S: int, K: int, m: int, stages: int,
    device: str,
) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """Per stage: (initial centroid tokens ``[G, K]``, Lloyd sample tokens ``[G, m]`` sorted)
    for the heads ``[(b, global_head), ...]``, on ``device``: one seeded permutation per head
    and stage. Computed on the host once, then reused (a stream packs chunks of one size with
    the same heads, layer after layer), so a quantize on a GPU draws nothing on the host and
    copies nothing to the device. The tensors are shared: callers only read them."""
    gens = [torch.Generator().manual_seed(head_seed(seed, b, h)) for b, h in heads]
    out = []
    for _ in range(stages):
        perms = torch.stack([torch.randperm(S, generator=g) for g in gens])  # [G, S]
        sample = perms[:, :m].sort(dim=1).values if m < S else perms[:, :0]
        out.append((perms[:, :K].to(device), sample.to(device)))
    return tuple(out)


def _mul_pow2(
    t: torch.Tensor, e: torch.Tensor, dtype: torch.dtype, work: torch.dtype
) -> torch.Tensor:
    """``t [G, ...] * 2**e[g]`` as ``dtype``, computed in ``work`` (float32 or float64), with
    ``e [G]`` an int tensor on ``t``'s device (no host sync): two multiplies by normal powers
    of two of ``work`` (exact unless a value lands in the subnormal range; ``e`` beyond twice
    the range saturates to 0 or inf, as the exact product would in ``dtype``). In float64 the
    product is exact and rounded once to ``dtype``; callers pick float64 where ``e`` may exceed
    float32's doubled range (float64 inputs, the centroids of any head)."""
    shape = (-1,) + (1,) * (t.dim() - 1)
    lo, hi = (-1022, 1023) if work == torch.float64 else (-126, 127)
    a = e.clamp(lo, hi)
    out = t.to(work) * pow2(a, work).view(shape)
    out.mul_(pow2((e - a).clamp(lo, hi), work).view(shape))  # 2**0 unless outside
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
    check_segment("quantize", x)
    if not is_int(head_offset, 0):
        raise CodecError(f"quantize: head_offset must be an int >= 0 (global index of x's "
                         f"first head), got {head_offset!r}")
    B, H, S, D = (int(v) for v in x.shape)
    _check_args(args, D)
    if codebooks is not None and (len(codebooks) != args.stages or any(
        (c.dtype, *c.shape[:2], *c.shape[3:]) != (torch.bfloat16, B, H, D) for c in codebooks
    )):
        raise CodecError(f"quantize: codebooks must be {args.stages} bf16 tensor(s) of shape "
                         f"[{B}, {H}, K, {D}], got {[(tuple(c.shape), c.dtype) for c in codebooks]}")
    if B * H * S == 0:
        raise CodecError(f"quantize: empty segment {tuple(x.shape)}; nothing to pack")
    # Per-head absolute maxima: NaN/inf propagate, so one read covers the non-finite check
    # and the per-head normalization exponents.
    flat_amax = torch.maximum(x.amax(dim=(2, 3)), x.amin(dim=(2, 3)).neg()).reshape(-1)
    impl = _IMPLS[resolve_backend(backend, x.device)]
    BH = B * H
    # Normalize each head by a power of two (exact) so |x| <= 1: k-means distances cannot
    # overflow fp32 for any bf16-range input, and the codec is exactly equivariant to 2^k.
    finite = torch.isfinite(flat_amax)
    poisoned: torch.Tensor | None = ~finite
    if _host_checked(x.device):  # refused here; elsewhere packed poisoned (no host sync)
        if bool(poisoned.any()):
            bad = int((~torch.isfinite(x)).sum())
            raise CodecError(f"quantize: input has {bad} non-finite value(s) (NaN or inf) out "
                             f"of {x.numel()}; PRQ needs finite K/V")
        poisoned = None
    # frexp is exact in any float dtype
    norm = torch.where((flat_amax > 0) & finite, torch.frexp(flat_amax)[1], 0)
    # Groups of heads, each packed as a segment [1, G, S, D], joined along the heads (every
    # operation is per head, so the grouping does not change a bit).
    group = _head_group(x.device, BH, S)
    parts = []
    for g0 in range(0, BH, group):
        g1 = min(g0 + group, BH)
        xg = (x[g0 // H, g0 % H].unsqueeze(0) if group == 1 else
              torch.stack([x[i // H, i % H] for i in range(g0, g1)]) if B > 1 else x[0, g0:g1])
        parts.append(_quantize_heads(
            xg, norm[g0:g1], args, impl, seed=seed,
            heads=[(i // H, head_offset + i % H) for i in range(g0, g1)],
            codebooks=None if codebooks is None else [
                c.reshape(BH, -1, D)[g0:g1] for c in codebooks],
            poisoned=None if poisoned is None else poisoned[g0:g1],
        ))
    seg = PackedSegment.cat_heads(parts)._map(lambda t: t.view(B, H, *t.shape[2:]),
                                              shape=(B, H, S, D))
    if codebooks is not None:  # the very tensors given, not copies
        seg.centroids = list(codebooks)
    if poisoned is not None:
        seg.scale_exp.view(BH).masked_fill_(poisoned, POISON_SCALE_EXP)
    return seg


# also here: torch.compile(quantize) compiles the undecorated function under the entry's
# decoration, and k-means and the block scales must still run eagerly
@torch.compiler.disable(reason="k-means and the block scales must give eager's codes bit for bit")
def _quantize_heads(
    xg: torch.Tensor,
    norm: torch.Tensor,
    args: CodecSettings,
    impl,
    *,
    seed: int,
    heads: list[tuple[int, int]],
    codebooks: list[torch.Tensor] | None,
    poisoned: torch.Tensor | None = None,
):
    """PRQ of ``G`` heads ``xg [G, S, D]`` into a segment ``[1, G, S, D]`` (no centroids when
    ``codebooks`` are given); ``norm [G]``: each head's normalization exponent
    (an int tensor on ``xg``'s device), ``heads[g]``: its (batch index, global head index);
    ``poisoned [G]`` (the device path, None on the CPU): heads whose input is not finite,
    packed as zeros (their exponent is poisoned afterwards). Only on the CPU is a value of
    ``norm`` read on the host.

    Every operation is per head (batched GEMMs, row-wise reductions, row gathers), so a head's
    result does not depend on the others.
    """
    G, S, D = xg.shape
    bits, block, grid = args.bits, args.block_size, args.grid
    nb = D // block
    dev = xg.device
    host = poisoned is None  # the CPU path: ``norm`` may be read on the host
    e = norm.to(torch.int32)
    if host and -125 <= int(e.min()) and int(e.max()) <= 120:  # |xf| <= 1: cast, scale in place
        xf = temporary("quantize.x", G * S * D, torch.float32, dev).view(G, S, D).copy_(xg)
        if bool(e.any()):
            xf.mul_(pow2(-e, torch.float32).view(G, 1, 1))
    else:  # float32 work covers +-254: every exponent of a float32/bf16/fp16 input's head
        work = torch.float64 if host or xg.dtype == torch.float64 else torch.float32
        xf = _mul_pow2(xg, -e, torch.float32, work).contiguous()
        if poisoned is not None:  # NaN/inf would only derail k-means: pack zeros instead
            xf.masked_fill_(poisoned.view(G, 1, 1), 0.0)
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
            c32 = _mul_pow2(codebooks[stage], -e, torch.float32, torch.float64)
        else:
            pick, sample = draws[stage]
            c = _rows(resid, pick)
            xs = _rows(resid, sample, "quantize.sample") if sample.shape[1] else resid
            for _ in range(args.kmeans_iters):
                a = impl.kmeans_assign(xs, c)
                c = impl.kmeans_update(xs, a, c)
            c_bf = c.to(torch.bfloat16)
            c32 = c_bf.float()
            cents.append(_mul_pow2(c_bf, e, torch.bfloat16, torch.float64))
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
        z = torch.floor(-bmin / torch.where(dec > 0, dec, 1.0) + 0.5) - 2 ** (bits - 1)
        zeros = torch.where(dec > 0, z, 0.0).to(torch.int8)
    packed = impl.quantize_pack(r, dec, zeros, bits=bits, block=block, grid=grid)
    return PackedSegment(
        centroids=[c.view(1, G, -1, D) for c in cents],
        ids=[i.view(1, G, S) for i in ids],
        codes=packed.view(1, G, S, -1),
        scales=enc.view(1, G, S, nb).view(torch.float8_e4m3fn),
        zeros=None if zeros is None else zeros.view(1, G, S, nb),
        scale_exp=(exp + e).to(torch.int16).view(1, G),
        shape=(1, G, S, D),
        dtype=xg.dtype,
        bits=bits,
        block_size=block,
        grid="reference" if args.asymmetric else grid,
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
    if out is None:
        out = torch.empty(tuple(packed.shape), dtype=dtype, device=packed.device)
    else:
        check_out("dequantize", packed, out)
    if out.numel():
        _IMPLS[resolve_backend(backend, packed.device)].dequantize_into(packed, out)
    return out


# a PackedSegment is read through the codec seam: decoded here, attended by the Triton kernel
register_record(PackedSegment, decode_into=lambda packed, out: dequantize(packed, out=out),
                attention_module="causalkv.caches.codecs.prq.attention")
