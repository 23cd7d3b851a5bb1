"""The codec conformance check: does a `KVCodec` keep the contract the cache relies on?

`check_codec` encodes one small probe segment and decodes it the ways the cache does, and
refuses, with a `CodecConformanceError` naming the codec, the check and the fix, a codec that
breaks any of these (`CHECKS`, in the order they run):

========  ==============================================================================
check     what must hold
========  ==============================================================================
encode    ``encode(x)`` returns without raising
record    what it returns is a `PackedRecord` (every attribute of the protocol) of a type
          registered with `register_record` (so a view's reader can decode it)
shape     ``record.shape`` is ``x``'s ``(B, H, S, D)``, ``record.device`` ``x``'s device, and
          ``record.dtype`` (when the record has one) ``x``'s dtype
parts     a `TensorRecord`'s every part is ``[B, H, S, ...]`` (a per-token tensor holding every
          token the record claims)
nbytes    ``record.nbytes`` equals the codec's ``nbytes(shape)`` and the bytes of the tensors
          the record holds (each distinct tensor once; a `TensorRecord`: its parts and whole)
decode    ``decode_into(record, out)`` returns without raising, into a float32 ``out`` with the
          strides the cache uses (a ``[B, S, H, D]`` buffer seen as ``[B, H, S, D]``)
finite    it wrote every element of ``out``, all finite (``out`` is filled with NaN first,
          so a decode that writes nothing, or part, is caught)
bound     every element is within the codec's declared `KVCodec.error_bound` of ``x`` (a
          decode that writes zeros, or the wrong values, is caught: the probe's channels have
          offsets, so zeros exceed any bound that a codec could honestly declare)
dtype     a decode into ``out`` of ``x``'s dtype (the cache's) matches the float32 decode to
          that dtype's rounding
views     heads and tokens selected as views (``select_heads``, ``select_tokens``) decode,
          through the registered reader, to the same values as the whole record's slice
========  ==============================================================================

The probe (`probe_segment`) is deterministic: ``[1, 2, 256, head_dim]`` by default, per
(head, channel) an offset of 3 standard deviations' spread plus per-token noise (keys carry
such channel offsets), the second head 8 times the first; bf16, on the CPU. It takes a few
milliseconds for every built-in codec.

**For codec authors.** Run it in your own tests::

    from causalkv.caches.codecs.conformance import check_codec
    check_codec(MyCodec(), head_dim=128)   # raises CodecConformanceError naming the failure

**In causalkv.** The first time a codec setting (its name, target and parameters, and the
codec options it `reads`) is used in a process, `check_first_use` runs the check once and
remembers the outcome: `causalkv.caches.codecs.make_codec` runs it at a default geometry, and
the start-up check every host makes (`QVGCodecOptions.layout_problem`, through
`causalkv.caches.codecs.codec_problem`) at the model's ``head_dim``, so every host refuses a
broken codec with one line before any weights load. The check
runs on the CPU (a codec's device kernels are not exercised by it).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from causalkv.caches.codecs.base import (
    CodecError,
    KVCodec,
    PackedRecord,
    TensorRecord,
    record_kind,
)
from causalkv.errors import ConfigError, describe_exception

if TYPE_CHECKING:
    from causalkv.caches.codecs import CodecSetting

__all__ = [
    "CHECKS",
    "CodecConformanceError",
    "ConformanceReport",
    "check_codec",
    "check_first_use",
    "probe_segment",
    "stored_tensors",
]

#: the checks `check_codec` makes, in order (module docstring)
CHECKS: tuple[str, ...] = (
    "encode", "record", "shape", "parts", "nbytes", "decode", "finite", "bound", "dtype", "views",
)

#: head_dims the first use of a setting tries, in order, when the caller knows none
DEFAULT_HEAD_DIMS: tuple[int, ...] = (128, 64, 256, 32, 16)

#: relative rounding of a decode into each dtype (half a unit in the last place)
_ROUNDING = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11,
             torch.float64: 2.0**-53}


class CodecConformanceError(CodecError):
    """A codec broke the contract `check_codec` checks (a `CodecError`, so a ``ValueError``).

    The message is one line: the codec, the check, what went wrong, and the fix.

    Attributes:
        codec: how the codec was named (``"codec setting 'int8' (my_plugin.int8:Int8Codec)"``).
        check: the failed check, one of `CHECKS`.
        problem: what went wrong.
        fix: what to change.
    """

    def __init__(self, codec: str, check: str, problem: str, fix: str) -> None:
        super().__init__(f"KV codec {codec} failed the conformance check '{check}': {problem}; {fix}")
        self.codec, self.check, self.problem, self.fix = codec, check, problem, fix


@dataclass(frozen=True)
class ConformanceReport:
    """What a passing `check_codec` measured.

    Attributes:
        codec: how the codec was named.
        shape: the probe's ``(B, H, S, D)``.
        dtype: the probe's dtype.
        nbytes: the record's bytes (equal to ``codec.nbytes(shape)``).
        max_error: the largest ``|decoded - x|`` (float32 decode).
        bound_used: the largest ratio of an element's error to its declared bound (<= 1).
    """

    codec: str
    shape: tuple[int, int, int, int]
    dtype: torch.dtype
    nbytes: int
    max_error: float
    bound_used: float


def probe_segment(
    head_dim: int, *, batch: int = 1, heads: int = 2, tokens: int = 256,
    dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu", seed: int = 0,
) -> torch.Tensor:
    """The deterministic probe ``x [batch, heads, tokens, head_dim]`` of ``dtype``: per
    (batch, head, channel) an offset ``3 * N(0, 1)``, plus ``N(0, 1)`` per element, head ``h``
    scaled by ``8**h`` (drawn on the CPU from ``seed``, then moved to ``device``)."""
    g = torch.Generator().manual_seed(seed)
    offset = 3.0 * torch.randn(batch, heads, 1, head_dim, generator=g)
    x = offset + torch.randn(batch, heads, tokens, head_dim, generator=g)
    x = x * (8.0 ** torch.arange(heads, dtype=torch.float32)).view(1, heads, 1, 1)
    return x.to(dtype=dtype, device=device)


def _tensors(value: Any, found: dict[tuple[Hashable, ...], torch.Tensor], depth: int = 0) -> None:
    """Collect the tensors in ``value`` (a tensor, or lists, tuples and dicts of them)."""
    if isinstance(value, torch.Tensor):
        key = (value.data_ptr(), value.dtype, tuple(value.shape), value.stride(), value.device)
        found.setdefault(key, value)
    elif depth < 4 and isinstance(value, (list, tuple, dict)):
        for item in value.values() if isinstance(value, dict) else value:
            _tensors(item, found, depth + 1)


def stored_tensors(record: object) -> list[torch.Tensor]:
    """The distinct tensors ``record`` holds in its attributes (a dataclass's fields among
    them; ``__dict__`` and ``__slots__``): tensors, and lists, tuples and dicts of them."""
    values = list(getattr(record, "__dict__", {}).values())
    values += [getattr(record, n) for n in getattr(type(record), "__slots__", ()) if hasattr(record, n)]
    found: dict[tuple[Hashable, ...], torch.Tensor] = {}
    _tensors(values, found, depth=-1)  # the attributes' values at depth 0
    return list(found.values())


def _at(t: torch.Tensor) -> tuple[int, ...]:
    """The index of ``t``'s largest element (the first, for a tie)."""
    return tuple(int(i) for i in torch.unravel_index(t.reshape(-1).argmax(), t.shape))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_codec(
    codec: KVCodec,
    *,
    head_dim: int = 128,
    tokens: int = 256,
    heads: int = 2,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    name: str | None = None,
) -> ConformanceReport:
    """Check ``codec`` against the codec contract on `probe_segment` (module docstring).

    Args:
        codec: the codec, configured (``make_codec(name, settings)`` or your class).
        head_dim: ``D`` of the probe; pick one the codec packs (`KVCodec.layout_problem`).
        tokens: ``S`` of the probe.
        heads: ``H`` of the probe (at least 2: the views check selects the second head).
        dtype: the probe's dtype (the cache's K/V dtype; bf16 by default).
        device: where the probe is made and the codec runs.
        name: how messages name the codec (default: its ``name`` and class).

    Returns:
        What the check measured (`ConformanceReport`).

    Raises:
        CodecConformanceError: the first check that fails (`CHECKS`), naming the codec, the
            check and the fix.
        CodecError: ``head_dim`` is one the codec says it cannot pack, or ``heads < 2``.
        ConfigError: ``encode`` raised it: a setting the codec reads is wrong (PRQ's
            ``CAUSALKV_QVG_BACKEND``, say); passed on unchanged and not remembered by
            `check_first_use`, so the run names the setting and a fixed setting is checked.
    """
    cls = type(codec)
    label = name or f"{codec.name or cls.__name__!r} ({cls.__module__}:{cls.__qualname__})"
    if heads < 2:
        raise CodecError(f"check_codec: heads must be >= 2, got {heads}")
    layout = codec.layout_problem(head_dim)
    if layout is not None:
        raise CodecError(f"check_codec: {label} cannot pack head_dim={head_dim} ({layout}); pass another head_dim")

    def fail(check: str, problem: str, fix: str) -> CodecConformanceError:
        return CodecConformanceError(label, check, problem, fix)

    @contextmanager
    def failing(check: str, what: str, fix: str, passing: tuple[type, ...] = ()) -> Iterator[None]:
        """Any exception of the block but ``passing`` becomes the failure of ``check``: ``what``
        raised it."""
        try:
            yield
        except passing:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure is the codec's, named
            raise fail(check, f"{what} raised {describe_exception(exc)}", fix) from exc

    x = probe_segment(head_dim, heads=heads, tokens=tokens, dtype=dtype, device=device)
    shape = tuple(x.shape)
    B, H, S, D = shape
    # a ConfigError passes: a setting the codec reads is wrong (its backend, say), the user's to fix
    with failing("encode", f"encode of a {list(shape)} {_name(dtype)} segment",
                 "encode must pack any finite [B, H, S, D] float segment of a head_dim it accepts",
                 passing=(ConfigError,)):
        record = codec.encode(x)

    # ---- the record ----
    if not isinstance(record, PackedRecord):
        missing = [n for n in dir(PackedRecord) if n[0] != "_" and not hasattr(record, n)]
        raise fail("record", f"encode returned a {type(record).__name__} without {', '.join(missing)}",
                   "return a PackedRecord (causalkv.caches.codecs.base.TensorRecord is a ready-made one)")
    kind = record_kind(record)
    if kind is None:
        raise fail("record", f"its record type {type(record).__name__} is not registered",
                   "call causalkv.caches.codecs.base.register_record(YourRecord, decode_into=...) "
                   "in the codec's module")
    claimed = tuple(int(v) for v in record.shape)
    if claimed != shape:
        raise fail("shape", f"the record claims shape {claimed}, the segment encoded is {shape}",
                   "set the record's shape to the logical (B, H, S, D) of x")
    if torch.device(record.device) != x.device:
        raise fail("shape", f"the record is on {record.device}, the segment on {x.device}",
                   "keep the record on x's device")
    rdtype = getattr(record, "dtype", None)
    if isinstance(rdtype, torch.dtype) and rdtype != dtype:
        raise fail("shape", f"the record's dtype is {_name(rdtype)}, the segment's {_name(dtype)}",
                   "record the dtype that was encoded (x.dtype)")
    if isinstance(record, TensorRecord):
        for part, t in record.parts.items():
            if tuple(t.shape[:3]) != (B, H, S):
                raise fail("parts", f"part {part!r} is {list(t.shape)}, so it holds "
                           f"{list(t.shape[:3])} (batch, heads, tokens) where the record claims {[B, H, S]}",
                           "store every part as [B, H, S, ...] of the whole segment (or put a tensor "
                           "of the whole record in TensorRecord.whole)")

    # ---- the bytes ----
    formula = int(codec.nbytes(shape))
    held = stored_tensors(record)
    stored = sum(int(t.nbytes) for t in held)
    said = int(record.nbytes)
    if said != formula or (held and stored != formula):
        parts = ", ".join(f"{list(t.shape)} {_name(t.dtype)} {t.nbytes}" for t in held)
        holds = f", the tensors the record holds = {stored:,} B ({parts})" if held else ""
        raise fail("nbytes", f"nbytes({shape}) = {formula:,} B, record.nbytes = {said:,} B{holds}",
                   "make KVCodec.nbytes the exact byte count of every tensor encode stores (the cache "
                   "and the memory planner count with it)")

    # ---- the decode, as the cache does it: into a strided view it owns ----
    def decode(out_dtype: torch.dtype) -> torch.Tensor:
        buf = torch.full((B, S, H, D), float("nan"), dtype=out_dtype, device=x.device)
        out = buf.permute(0, 2, 1, 3)
        with failing("decode", f"decode_into into a {_name(out_dtype)} out of shape {list(shape)} "
                     f"with strides {list(out.stride())}", "decode_into must write any float out of "
                     "record.shape, of any strides, on record.device"):
            codec.decode_into(record, out)
        bad = ~torch.isfinite(out)
        if bool(bad.any()):
            raise fail("finite", f"decode_into left {int(bad.sum()):,} of {out.numel():,} elements of a "
                       f"NaN-filled {_name(out_dtype)} out non-finite (first at {list(_at(bad.to(torch.uint8)))})",
                       "decode_into must write every element of out, finite for a finite segment")
        return out

    got = decode(torch.float32)
    xd = x.double()
    err = (got.double() - xd).abs()
    with failing("bound", "error_bound", "error_bound(x) must return the allowed |decoded - x| per element"):
        bound = torch.as_tensor(codec.error_bound(x), dtype=torch.float64, device=x.device)
    if tuple(bound.shape) != shape or not bool(torch.isfinite(bound).all()) or bool((bound < 0).any()):
        raise fail("bound", f"error_bound returned {list(bound.shape)} values, not {list(shape)} finite "
                   "ones >= 0", "error_bound(x) must return the allowed |decoded - x| per element of x")
    allowed = bound + _ROUNDING[torch.float32] * xd.abs()
    ratio = err / allowed.clamp_min(torch.finfo(torch.float64).tiny)
    used = float(ratio.max())
    if used > 1:
        at = _at(ratio)
        raise fail("bound", f"element {list(at)} decodes to {got[at].item():.6g} for x = {xd[at].item():.6g}, "
                   f"off by {err[at].item():.4g} where error_bound allows {bound[at].item():.4g} "
                   f"({int((ratio > 1).sum()):,} of {err.numel():,} elements beyond it)",
                   "decode_into must reconstruct the values encode packed (it wrote zeros or wrong "
                   "values), or error_bound must state the error the format allows")

    if dtype in _ROUNDING and dtype != torch.float32:
        narrow = decode(dtype).double()
        off = (narrow - got.double()).abs()
        tol = 2 * _ROUNDING[dtype] * got.double().abs() + _ROUNDING[torch.float32] * allowed
        if bool((off > tol).any()):
            at = _at(off - tol)
            raise fail("dtype", f"a decode into a {_name(dtype)} out gives {narrow[at].item():.6g} at {list(at)}, "
                       f"the float32 decode {got[at].item():.6g}",
                       "decode_into must write the same reconstruction into any float dtype of out")

    # ---- views: what a streaming reader decodes ----
    a, b = S // 4, S // 2 + 1
    with failing("views", f"select_heads(1, {H}).select_tokens({a}, {b}) then its registered decode",
                 "select_heads/select_tokens must return records of those heads and tokens "
                 "(views), which the registered decode_into reads"):
        view = record.select_heads(1, H).select_tokens(a, b)
        vshape = tuple(int(v) for v in view.shape)
        if vshape != (B, H - 1, b - a, D):
            raise CodecError(f"the view claims shape {vshape}, not {(B, H - 1, b - a, D)}")
        part = torch.full(vshape, float("nan"), dtype=torch.float32, device=x.device)
        kind.decode_into(view, part)
    want = got[:, 1:H, a:b]
    if not torch.allclose(part, want, rtol=2.0**-20, atol=0.0, equal_nan=False):
        diff = (part.double() - want.double()).abs().nan_to_num(float("inf"))
        at = _at(diff)
        raise fail("views", f"heads [1, {H}) and tokens [{a}, {b}) selected as a view decode to "
                   f"{part[at].item():.6g} at {list(at)}, the whole record's decode to {want[at].item():.6g}",
                   "select_heads/select_tokens must slice every per-head and per-token tensor alike")
    return ConformanceReport(label, shape, dtype, said, float(err.max()), used)


# ---- first use in a process ----------------------------------------------------------------------
_lock = threading.Lock()
#: (setting key, head_dim) -> None (passed) or the failure's (codec, check, problem, fix)
_outcomes: dict[tuple[Hashable, ...], tuple[str, str, str, str] | None] = {}


def check_first_use(
    codec: KVCodec, setting: CodecSetting, settings: Any, *, head_dim: int | None = None,
) -> None:
    """Run `check_codec` on ``codec`` (made from ``setting`` and the options record
    ``settings``) unless this process already did for this setting (its name, target,
    parameters and the values of the options the codec `reads`) at ``head_dim``; a failure is
    remembered and raised again at every later use.

    ``head_dim`` None (a codec made without a model, `make_codec`): any earlier check of the
    setting's name, target and parameters counts, whatever the options and the head_dim (a
    cache's derived settings, such as a span's centroid count, are not checked again mid-run);
    else the first of `DEFAULT_HEAD_DIMS` the codec packs is checked (none: nothing is
    checked, the model's layout check comes later). Bf16 probe on the CPU, or on CUDA when
    the codec's settings do not run on the CPU (`KVCodec.device_problem`); nothing is checked
    when they run on neither (the run's own device check names the setting).

    Raises:
        CodecConformanceError: the check failed (now or earlier in this process).
    """
    device = torch.device("cpu")
    if codec.device_problem(device) is not None:  # its settings do not run on the CPU (PRQ's
        # CAUSALKV_QVG_BACKEND=triton, say): probe where they run, else the run's device check
        # (`KVCodec.device_problem`) refuses them by name
        device = torch.device("cuda")
        if not torch.cuda.is_available() or codec.device_problem(device) is not None:
            return
    # the setting's name, target and parameters, and the values of the options it reads
    reads = tuple((f, repr(getattr(settings, f, None))) for f in sorted(codec.reads))
    key = (setting.name, setting.target, repr(sorted(setting.params.items())), reads)
    with _lock:
        if head_dim is None:  # an earlier check of the setting counts, else a default head_dim
            seen = [o for (k, _), o in _outcomes.items() if k[:3] == key[:3]]
            failed = next((o for o in seen if o is not None), None)
            if not seen:
                head_dim = next((d for d in DEFAULT_HEAD_DIMS if codec.layout_problem(d) is None), None)
        if head_dim is not None:
            if (key, head_dim) not in _outcomes:
                label = f"setting {setting.name!r} ({setting.target})"
                try:
                    check_codec(codec, head_dim=head_dim, name=label, device=device)
                    _outcomes[key, head_dim] = None
                except CodecConformanceError as exc:
                    _outcomes[key, head_dim] = (exc.codec, exc.check, exc.problem, exc.fix)
            failed = _outcomes[key, head_dim]
    if failed is not None:
        raise CodecConformanceError(*failed)
