"""The codec interface: `PackedRecord` (what a codec stores) and `KVCodec` (what it does).

Shapes: a codec packs one K or V segment ``x [B, H, S, D]`` (batch, heads, tokens, channels)
into a record of the same logical shape. The cache holds records only through this
interface: bytes, device, head and token slices (views), moves between devices, decoding
into a buffer it owns. Each record type is registered with its decoder (`register_record`),
so a reader that got a record from a view (streaming attention) decodes it, or hands it to
the record type's attention kernel, without knowing the format (`record_kind`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import torch

from causalkv.errors import CausalKVError

__all__ = [
    "CodecError",
    "KVCodec",
    "PackedRecord",
    "RecordKind",
    "RecordViews",
    "TensorRecord",
    "check_out",
    "check_segment",
    "decode_record",
    "record_kind",
    "register_record",
]


class CodecError(CausalKVError, ValueError):
    """A codec was given what it cannot pack or decode (a shape, dtype, setting or non-finite
    input; the message names the value and the fix)."""


@runtime_checkable
class PackedRecord(Protocol):
    """One packed K or V segment of logical shape ``[B, H, S, D]``."""

    @property
    def shape(self) -> tuple[int, int, int, int]: ...
    @property
    def nbytes(self) -> int:
        """Exactly the bytes stored (every tensor it holds)."""
    @property
    def device(self) -> torch.device: ...
    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedRecord: ...
    def pin_memory(self) -> PackedRecord: ...
    def select_heads(self, h0: int, h1: int) -> PackedRecord:
        """Heads ``[h0, h1)`` as views (no copy)."""
    def select_tokens(self, a: int, b: int) -> PackedRecord:
        """Tokens ``[a, b)`` as views (no copy)."""
    def shared_tensors(self) -> tuple[torch.Tensor, ...]:
        """Tensors other records may reference too (a shared codebook), counted once by a
        cache that holds several."""


class RecordViews:
    """`PackedRecord`'s moves and slices for a record whose ``_map(fn, kind, **changes)``
    applies ``fn`` to its tensors (``kind``: None for every tensor, ``"heads"`` / ``"tokens"``
    for those a head / token slice cuts) and makes ``changes``."""

    shape: tuple[int, int, int, int]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Any:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Any:
        """The same record in pinned host memory (CPU tensors only; needs a CUDA build)."""
        return self._map(lambda t: t.pin_memory())

    def select_heads(self, h0: int, h1: int) -> Any:
        """Heads ``[h0, h1)`` as views (no copy); shape becomes ``[B, h1 - h0, S, D]``."""
        B, H, S, D = self.shape
        if not 0 <= h0 < h1 <= H:
            raise CodecError(f"select_heads: need 0 <= h0 < h1 <= {H}, got h0={h0}, h1={h1}")
        return self._map(lambda t: t[:, h0:h1], "heads", shape=(B, h1 - h0, S, D))

    def select_tokens(self, a: int, b: int) -> Any:
        """Tokens ``[a, b)`` as views (no copy); shape becomes ``[B, H, b - a, D]``."""
        B, H, S, D = self.shape
        if not 0 <= a < b <= S:
            raise CodecError(f"select_tokens: need 0 <= a < b <= {S}, got a={a}, b={b}")
        if a == 0 and b == S:
            return self
        return self._map(lambda t: t[:, :, a:b], "tokens", shape=(B, H, b - a, D))


@dataclass(frozen=True, eq=False)
class TensorRecord(RecordViews):
    """A ready-made `PackedRecord` for codecs whose stored tensors are laid out per token.

    Attributes:
        shape: the logical ``(B, H, S, D)``.
        dtype: the dtype that was encoded.
        parts: tensors ``[B, H, S, ...]`` (codes, per-token or per-block scales), sliced along
            heads and tokens by `select_heads` / `select_tokens` (views).
        whole: tensors that belong to the whole record (a per-tensor scale), kept as they are
            by slicing (so a slice's `nbytes` counts them whole).
    """

    shape: tuple[int, int, int, int]
    dtype: torch.dtype
    parts: dict[str, torch.Tensor]
    whole: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return int(sum(t.nbytes for t in [*self.parts.values(), *self.whole.values()]))

    @property
    def device(self) -> torch.device:
        return next(iter(self.parts.values())).device

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor], kind: str | None = None,
             **changes: Any) -> Any:
        whole = self.whole if kind else {n: fn(t) for n, t in self.whole.items()}
        return replace(self, parts={n: fn(t) for n, t in self.parts.items()}, whole=whole,
                       **changes)

    def shared_tensors(self) -> tuple[torch.Tensor, ...]:
        return ()


class KVCodec(ABC):
    """A K/V codec configured for one cache (its settings fixed at construction).

    Subclasses implement `from_settings`, `encode`, `decode_into` and `nbytes`; `error_bound`
    (the error the codec promises; the default allows half of a token-head's largest
    magnitude) and `layout_problem` are optional. `causalkv.caches.codecs.conformance.check_codec`
    checks an implementation against this contract; causalkv runs it on the first use of
    each codec setting in a process.

    Attributes:
        name: how messages name it: the setting it was made from (`causalkv.caches.codecs.make_codec`
            sets it; ``"fp8"`` for a codec built directly).
        shares_codebooks: `encode` accepts ``codebooks`` (segments may share tensors).
        reads: the codec options it reads (see the attribute).
    """

    name: str = ""
    shares_codebooks: bool = False
    #: the codec options it reads (fields of `causalkv.caches.qvg.options.QVGCodecOptions`
    #: beyond ``codec``: PRQ's ``centroids``, ``block_size``, ...); a user who sets another away
    #: from its default is refused at start-up, never silently ignored
    reads: frozenset[str] = frozenset()

    @classmethod
    @abstractmethod
    def from_settings(cls, settings: Any, **params: Any) -> KVCodec:
        """The codec for the cache's options record ``settings`` and the registered ``params``."""

    @abstractmethod
    def encode(
        self, x: torch.Tensor, *, seed: int = 1234, head_offset: int = 0,
        codebooks: list[torch.Tensor] | None = None,
    ) -> PackedRecord:
        """Pack ``x [B, H, S, D]`` (any float dtype, any strides) into a record of logical
        shape ``(B, H, S, D)`` whose `PackedRecord.nbytes` is `nbytes` of that shape.
        Deterministic: the same ``x`` and arguments give the same record.

        The keywords are the cache's; a codec that has no use for one ignores it:

        - ``seed``: for a codec that draws (PRQ's k-means initialization); combine it with
          ``head_offset`` so a head's draws do not depend on which rank packs it.
        - ``head_offset``: the global index of ``x``'s first head (``rank * H`` when ranks
          split the heads); a codec whose result per head depends only on that head's input
          ignores it.
        - ``codebooks``: only for a codec with ``shares_codebooks = True``: the tensors of an
          earlier record of this codec (its `PackedRecord.shared_tensors`) to reuse instead of
          computing new ones; the record then references those very tensors. The cache passes
          None to every other codec.

        Raises:
            CodecError: a bad shape or dtype, or non-finite input (on the CPU).
        """

    @abstractmethod
    def decode_into(self, record: PackedRecord, out: torch.Tensor) -> None:
        """Write the reconstruction of ``record`` into ``out``.

        ``out`` is a buffer the caller owns and keeps: a float tensor of shape
        ``record.shape`` (``[B, H, S, D]``), on ``record.device``, of any float dtype (the
        cache's, bf16 usually; float32 in the conformance check) and any strides (the cache
        passes views such as ``buf.permute(0, 2, 1, 3)[:, :, a:b]`` of a ``[B, S, H, D]``
        buffer). Write every element of it, in place (never rebind or resize it), and keep
        no reference to it; what it held before is garbage. `check_out` refuses a wrong one.
        """

    @abstractmethod
    def nbytes(self, shape: tuple[int, int, int, int]) -> int:
        """Exactly the bytes `encode` stores for a segment of ``shape = (B, H, S, D)``."""

    def shared_nbytes(self, shape: tuple[int, int, int, int]) -> int:
        """The part of ``nbytes(shape)`` held in tensors a segment encoded with its
        ``codebooks`` shares with later ones (`shares_codebooks`; a cache holding several
        counts them once). 0 for a codec that shares none."""
        return 0

    def layout_problem(self, head_dim: int) -> str | None:
        """Why this codec cannot pack ``head_dim`` channels (None when it can)."""
        return None

    def device_problem(self, device: torch.device) -> str | None:
        """Why this codec cannot run on ``device`` (None when it can): checked at start-up."""
        return None

    def request_lines(self, span_tokens: int, whole_sink_tokens: int = 0) -> list[str]:
        """The run header's lines for this codec's own parameters, given the tokens of a packed
        span (and of a sink packed whole, 0 when it is not): none by default."""
        return []

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """The error this codec promises: for ``x [B, H, S, D]`` (what `encode` is given), the
        largest ``|decoded - x|`` it allows at each element, a float64 ``[B, H, S, D]`` on
        ``x``'s device, for a decode into a float32 ``out`` (a narrower ``out`` adds its own
        rounding). Derived from the format, not measured: the conformance check
        (`causalkv.caches.codecs.conformance`) refuses a codec whose reconstruction of its
        probe exceeds it anywhere.

        Default: half of each token-head's largest ``|x|`` (rounding every element to the
        nearest of ``-amax, 0, amax`` keeps within it; a decode that writes zeros does not).
        A codec states its own, tighter bound by overriding this.
        """
        amax = x.detach().double().abs().amax(dim=-1, keepdim=True)
        return (amax / 2).expand(x.shape).contiguous()

    def bits_per_element(self, S: int, D: int) -> float:
        """Stored bits per element of one head's ``[S, D]`` segment: ``8 * nbytes / (S * D)``."""
        return 8.0 * self.nbytes((1, 1, S, D)) / (S * D)

    def decode(self, record: PackedRecord, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """A new contiguous ``[B, H, S, D]`` tensor of ``dtype`` holding the reconstruction."""
        out = torch.empty(tuple(record.shape), dtype=dtype, device=record.device)
        if out.numel():
            self.decode_into(record, out)
        return out

    def check_encode(self, x: torch.Tensor) -> None:
        """Refuse an ``x`` `encode` cannot pack (`CodecError` naming the codec): what
        `check_segment` refuses, a head_dim `layout_problem` names, and (on the CPU) NaN/inf."""
        check_segment(self.name, x)
        problem = self.layout_problem(x.shape[-1])
        if problem is not None:
            raise CodecError(f"{self.name} encode: {problem}")
        if x.device.type == "cpu":
            bad = int((~torch.isfinite(x)).sum())
            if bad:
                raise CodecError(f"{self.name} encode: {bad} NaN/inf value(s) in x; refusing to pack")

    def check_out(self, record: PackedRecord, out: torch.Tensor) -> None:
        """Refuse an ``out`` `decode_into` cannot write (`check_out`, naming the codec)."""
        check_out(f"{self.name} decode", record, out)


def check_out(label: str, record: PackedRecord, out: torch.Tensor) -> None:
    """Refuse an ``out`` a decode of ``record`` cannot write (`CodecError`, starting with
    ``label``): a shape other than ``record.shape``, a device other than ``record.device``, or
    a dtype that is not floating point. Strides and the float dtype are not checked (any is
    fine); nothing is written."""
    shape = tuple(record.shape)
    if tuple(out.shape) != shape:
        raise CodecError(f"{label}: out has shape {tuple(out.shape)}, the record is {shape}")
    if out.device != record.device:
        raise CodecError(
            f"{label}: out is on {out.device}, the record on {record.device}; "
            "move the record with record.to(device) first"
        )
    if not out.is_floating_point():
        raise CodecError(f"{label}: out must be a float tensor, got {out.dtype}")


@dataclass(frozen=True)
class RecordKind:
    """How a record type is read without its codec object.

    Attributes:
        decode_into: ``(record, out)`` writes the reconstruction into ``out [B, H, S, D]``.
        attention_module: the module of an attention kernel straight over records of this
            type (``supports``, ``packed_attention``, ``workspace_nbytes``,
            ``PackedAttentionError``; imported on first use), or None: readers decode first.
    """

    decode_into: Callable[[Any, torch.Tensor], None]
    attention_module: str | None = None


_KINDS: dict[type, RecordKind] = {}


def register_record(
    cls: type, *, decode_into: Callable[[Any, torch.Tensor], None],
    attention_module: str | None = None,
) -> None:
    """Register record type ``cls`` (done by the module that produces such records)."""
    _KINDS[cls] = RecordKind(decode_into, attention_module)


def record_kind(record: object) -> RecordKind | None:
    """The `RecordKind` of ``record``'s type, or None when it is not a packed record (a tensor)."""
    return next((_KINDS[cls] for cls in type(record).__mro__ if cls in _KINDS), None)


def decode_record(record: PackedRecord, dtype: torch.dtype) -> torch.Tensor:
    """``record`` decoded into a new ``[B, H, S, D]`` tensor of ``dtype``.

    Raises:
        CodecError: ``record`` is of no registered record type.
    """
    kind = record_kind(record)
    if kind is None:
        raise CodecError(f"decode: {type(record).__name__} is not a registered packed record type")
    out = torch.empty(tuple(record.shape), dtype=dtype, device=record.device)
    if out.numel():
        kind.decode_into(record, out)
    return out


def check_segment(name: str, x: torch.Tensor) -> None:
    """Refuse what no codec packs (`CodecError` naming the codec ``name``): an ``x`` that is
    not 4-D ``[B, H, S, D]``, or not floating point. Nothing else is checked: the sizes, the
    device, the strides and the values (finiteness) are the codec's to check."""
    if x.dim() != 4:
        raise CodecError(f"{name} encode: expected x of shape [B, H, S, D], got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise CodecError(f"{name} encode: expected a floating-point tensor, got {x.dtype}")
