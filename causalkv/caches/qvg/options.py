"""The QVG cache's settings, declared once: codec options and packing options.

- `QVGCodecOptions`: how one segment is packed: the codec setting by name (``codec``:
  ``int4``, ``int2``, ``fp8``, ``nvfp4`` or one a plugin registered, see
  `causalkv.caches.codecs`) and PRQ's own knobs (centroids, block size, stages, k-means
  iterations, zero points, the residual grid), which the PRQ settings read.
- `QVGPackingOptions`: which chunks are packed and how they are grouped (keep-recent, the
  sink, spans, shared codebooks). The packing policies (`causalkv.caches.qvg.policy`) and the
  segment store read these.
- `QVGKVQuantArgs`: both, the record the ``qvg`` cache factory declares
  (``CacheFactory("qvg", ..., options=QVGKVQuantArgs)``) and the reference runtime's class
  (same name, field names, defaults, dict keys and flags, so configs carry over).

Each field's flag, dict key, bounds and help are written once, in its declaration; the
command line, `QVGKVQuantArgs.from_dict` and the validation messages (the reference
runtime's) derive from them. Torch-free: importing this module loads no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from causalkv.caches.codecs import codec_names, codec_problem, codec_setting
from causalkv.errors import ConfigError, is_int
from causalkv.options import CacheOptions, option

__all__ = [
    "quant_choices",
    "recent_tiers",
    "QVGCodecOptions",
    "QVGKVQuantArgs",
    "QVGPackingOptions",
]

_OFF = ("off", "none")
_SINK_SPANS = ("chunk", "full")
_GRIDS = ("reference", "mse4")


def quant_choices() -> tuple[str, ...]:
    """``--kv-cache-quant``'s choices: ``off`` and every registered codec setting."""
    return ("off", *codec_names())


def recent_tiers() -> tuple[str, ...]:
    """``--kv-cache-quant-recent-tier``'s choices: ``bf16`` and every registered codec setting."""
    return ("bf16", *codec_names())


def _codec_name(value: Any) -> str | None:
    """``--kv-cache-quant`` / ``kv_cache_quant``: ``off`` (or None) or a registered codec
    setting; the reference runtime's bit counts 4 and 2 read as ``int4`` and ``int2``."""
    if value is None or (isinstance(value, str) and value.lower() in _OFF):
        return None
    if is_int(value, None) and value in (2, 4):
        return f"int{value}"
    if not isinstance(value, str) or value.lower() not in codec_names():
        raise ConfigError(f"kv-cache-quant must be one of {list(quant_choices())}, got {value!r}")
    return value.lower()


def _tier_name(value: Any) -> str:
    """``--kv-cache-quant-recent-tier``: ``bf16`` or a registered codec setting."""
    key = value.lower() if isinstance(value, str) else value
    if key != "bf16" and key not in codec_names():
        raise ConfigError(
            f"kv-cache-quant-recent-tier must be one of {list(recent_tiers())}, got {value!r}"
        )
    return key


def _switch(value: Any) -> bool:
    """A 0/1 flag or dict value (``"0"``, 1, True) as a bool."""
    return bool(int(value)) if isinstance(value, (str, int)) else bool(value)


def _q(default: Any, flag: str, **spec: Any) -> Any:
    """A QVG field: `option` with ``flag`` and the reference runtime's dict key, the flag in
    snake case (``--kv-cache-quant-centroids``: ``kv_cache_quant_centroids``)."""
    return option(default, flag=flag, key=flag.lstrip("-").replace("-", "_"), **spec)


class _ReferenceMessages:
    """The reference runtime's message style: ``kv-cache-quant-centroids must be > 0``."""

    @classmethod
    def label_of(cls, name: str) -> str:
        return (cls.specs()[name].flag or name).lstrip("-")  # type: ignore[attr-defined]

    @classmethod
    def _int_problem(cls, minimum: int, *, optional: bool) -> str:
        return "must be > 0" if minimum == 1 else f"must be >= {minimum}"


@dataclass(frozen=True)
class QVGCodecOptions(_ReferenceMessages, CacheOptions):
    """Codec settings of one packed segment ``[B, H, S, D]`` (docs/qvg.md; a codec's own contract: docs/plugins.md).

    Attributes:
        codec: the codec setting (``None``: off; ``"int4"``, ``"int2"``: PRQ; ``"fp8"``,
            ``"nvfp4"``, or a name a plugin registered). The fields below are PRQ's.
        centroids: k-means centroids per (batch, head) per stage (<= 256: ids are uint8).
        block_size: channels per residual quantization block (must divide head_dim).
        stages: residual k-means stages.
        kmeans_iters: Lloyd iterations per stage.
        asymmetric: store a zero point per block (else symmetric codes ``-q..q``).
        grid: 2-bit residual grid: ``"reference"`` (symmetric codes -1..1, scale = absmax,
            or a zero point when asymmetric) or ``"mse4"`` (all four levels
            ``{-1.5,-0.5,0.5,1.5} * s`` with an error-minimizing scale). Beyond the reference.
    """

    title = "QVG codec"

    codec: str | None = _q(
        None, "--kv-cache-quant", choices=quant_choices, parse=_codec_name,
        help="pack cold KV-cache chunks with this codec: int4/int2 (QVG/PRQ), fp8, nvfp4 "
        "(default: off)",
    )
    centroids: int = _q(128, "--kv-cache-quant-centroids", type=int, minimum=1,
                        help="k-means centroids per head per stage, <= 256")
    block_size: int = _q(64, "--kv-cache-quant-block-size", type=int, minimum=1,
                         help="channels per residual scale block")
    stages: int = _q(1, "--kv-cache-quant-stages", type=int, minimum=1,
                     help="residual k-means stages")
    kmeans_iters: int = _q(2, "--kv-cache-quant-iters", type=int, minimum=1,
                           help="k-means iterations per stage")
    asymmetric: bool = _q(False, "--kv-cache-quant-asymmetric", action="store_true", parse=_switch,
                          help="store a zero point per residual block")
    grid: str = _q(
        "reference", "--kv-cache-quant-grid", choices=_GRIDS,
        help="residual grid at either bit width: mse4 uses all 2**bits levels with a least-squares "
        "scale (int2: 4 levels, int4: 16), reference the symmetric absmax grid (beyond the reference)",
    )

    @property
    def enabled(self) -> bool:
        return self.codec is not None

    @property
    def bits(self) -> int | None:
        """PRQ's residual bits: the ``bits`` parameter of the codec setting (4 for ``int4``,
        2 for ``int2``), None when off or for a codec without one (``fp8``, ``nvfp4``)."""
        return None if self.codec is None else codec_setting(self.codec).params.get("bits")

    def validate(self) -> Any:
        """The reference runtime's rules across fields (`ConfigError`, a ValueError)."""
        if self.codec is not None:
            codec_setting(self.codec)  # a registered name, or the message listing them
        if self.centroids > 256:
            raise ConfigError(
                f"kv-cache-quant-centroids must be <= 256 (cluster ids are uint8), got {self.centroids}"
            )
        return super().validate()

    def layout_problem(self, head_dim: int) -> str | None:
        """Why these settings cannot pack K/V of ``head_dim`` channels, or None when they can.

        Knowable before any weights load (``head_dim`` comes from the model's config): a host
        calls it at start-up, so a bad block size is refused before the first chunk. The
        codec says (``KVCodec.layout_problem``; this imports the codec's module), then the
        first use of the codec setting in the process is checked
        (`causalkv.caches.codecs.codec_problem`: a codec that breaks its contract is refused,
        naming the check).
        """
        if not self.enabled:
            return None
        problem = codec_problem(self.codec, self, head_dim)  # the layout, then conformance
        if problem is None and self.recent_tier != "bf16":
            problem = codec_problem(self.recent_tier, self, head_dim)
        return problem or self._unread_problem()

    def _unread(self) -> set[str]:
        """The codec options no codec in use (the codec, a recency tier) reads."""
        used = [c for c in (self.codec, self.recent_tier) if c not in (None, "bf16")]
        reads = frozenset().union(*(_reads_of(name) for name in used))
        return set(QVGCodecOptions.specs()) - {"codec"} - reads

    def to_mapping(self) -> dict[str, Any]:
        """Config key -> value of every declared field but the codec options no codec in use
        reads (PRQ's centroids with fp8, say): what the metrics' ``cache_settings`` show."""
        unread = self._unread()
        return {spec.key or n: getattr(self, n) for n, spec in self.specs().items() if n not in unread}

    def _unread_problem(self) -> str | None:
        """A codec option set away from its default that no codec in use reads (PRQ's
        ``--kv-cache-quant-centroids`` with fp8, say), or None: refused, never ignored."""
        unread = self._unread()
        for name, value in self.changed().items():
            if name not in unread:
                continue
            readers = [n for n in codec_names() if name in _reads_of(n)]
            using = f"--kv-cache-quant {self.codec}" + (
                f" with --kv-cache-quant-recent-tier {self.recent_tier}"
                if self.recent_tier != "bf16" else "")
            return (
                f"{self.specs()[name].flag} {value!r}: {using} does not read it (read by "
                f"{', '.join(readers) or 'no registered codec'}); drop the flag, or choose a "
                "codec that reads it"
            )
        return None

    def check_layout(self, head_dim: int) -> Any:
        """Raise `ConfigError` with `layout_problem`'s message when there is one; return self."""
        problem = self.layout_problem(head_dim)
        if problem is not None:
            raise ConfigError(problem)
        return self


def _reads_of(name: str) -> frozenset[str]:
    """The codec options the codec setting ``name`` reads (`KVCodec.reads`; imports its class,
    so torch: called at start-up only). A setting whose class does not import reads nothing
    here; using it is refused by name elsewhere."""
    try:
        return codec_setting(name).load().reads
    except ConfigError:
        return frozenset()


@dataclass(frozen=True)
class QVGPackingOptions(_ReferenceMessages, CacheOptions):
    """Which cold chunks are packed, and how they are grouped.

    Attributes:
        keep_recent_chunks: completed chunks kept in bf16 besides the current one.
        sink: quantize the attention sink too (True, the reference default); False keeps
            every chunk that holds sink tokens (stream-start sink or pinned shot sink) in bf16.
        sink_span: how sink chunks are packed when ``sink``: ``"chunk"`` one segment per
            chunk, ``"full"`` the whole sink as one span (one codebook).
        sink_keep_chunks: leading sink chunks kept in bf16 forever.
        span_chunks: cold chunks packed together as one segment (shares the codebook across
            chunks; beyond the reference, 1 = reference behaviour).
        codebook_chunks: consecutive cold chunks that share one k-means codebook, each still
            packed as soon as it is cold: the first runs k-means, the next ones only assign
            to its centroids, which are stored once (beyond the reference, 1 = reference).
        recent_tier: how the chunks kept out of the main codec are held: the newest
            ``keep_recent_chunks`` and, with ``sink=False``, the sink chunks (stream-start
            and pinned shot sink). ``"bf16"`` (the reference) or a codec setting (``"int4"``,
            ``"fp8"``, ...): packed with it, re-packed with the cache's codec once the policy
            no longer keeps them (beyond the reference). ``sink_keep_chunks`` stay bf16
            either way.
    """

    title = "QVG packing"

    keep_recent_chunks: int = _q(1, "--kv-cache-quant-keep-recent", type=int, minimum=0,
                                 help="completed chunks kept in bf16")
    sink: bool = _q(
        True, "--kv-cache-quant-sink", type=int, choices=(0, 1), parse=_switch,
        help="1: quantize the attention sink too; 0: keep sink chunks in bf16 (default: 1)",
    )
    sink_span: str = _q("chunk", "--kv-cache-quant-sink-span", choices=_SINK_SPANS,
                        help="pack the sink per chunk (chunk) or as one span (full)")
    sink_keep_chunks: int = _q(0, "--kv-cache-quant-sink-keep", type=int, minimum=0,
                               help="leading sink chunks kept in bf16 forever")
    span_chunks: int = _q(1, "--kv-cache-quant-span-chunks", type=int, minimum=1,
                          help="cold chunks packed as one segment sharing a codebook")
    codebook_chunks: int = _q(
        1, "--kv-cache-quant-codebook-chunks", type=int, minimum=1,
        help="consecutive cold chunks sharing one k-means codebook, each packed when cold "
        "(beyond the reference)",
    )
    recent_tier: str = _q(
        "bf16", "--kv-cache-quant-recent-tier", choices=recent_tiers, parse=_tier_name,
        help="how the keep-recent chunks (and, with --kv-cache-quant-sink 0, the sink chunks) "
        "are held: bf16, or a codec setting (e.g. int4, fp8: packed with it, re-packed with the "
        "cache's codec when they leave recency; beyond the reference)",
    )


@dataclass(frozen=True)
class QVGKVQuantArgs(QVGPackingOptions, QVGCodecOptions):
    """QVG (PRQ) KV-cache quantization settings: `QVGCodecOptions` + `QVGPackingOptions`.

    The options record of the ``qvg`` cache (``--kv-cache-quant int4|int2`` asks for the
    ``quant:qvg`` feature, which picks it) and the reference runtime's class. Validates
    itself on construction (`ConfigError`, a ValueError, with the reference's messages).
    """

    title = "QVG KV-cache quantization"

    @property
    def codec_options(self) -> QVGCodecOptions:
        """The codec part (what `quantize` reads)."""
        return QVGCodecOptions(**{n: getattr(self, n) for n in QVGCodecOptions.specs()})

    @property
    def packing(self) -> QVGPackingOptions:
        """The packing part (what the packing policies read)."""
        return QVGPackingOptions(**{n: getattr(self, n) for n in QVGPackingOptions.specs()})

    # ---- the record's hooks (causalkv.options.Options) -------------------------------------
    def check_used(self) -> None:
        """Settings that would do nothing are refused: any setting while quantization is
        off, a recency tier with nothing held at it."""
        if not self.enabled:
            changed = [self.specs()[n].flag for n in self.changed() if n != "codec"]
            if changed:
                raise ConfigError(
                    f"{', '.join(changed)} set(s) QVG quantization, which is off; pass "
                    f"--kv-cache-quant with a codec ({', '.join(codec_names())}), or drop them"
                )
            return
        if self.recent_tier != "bf16" and self.keep_recent_chunks == 0 and self.sink:
            raise ConfigError(
                f"--kv-cache-quant-recent-tier {self.recent_tier} holds the keep-recent chunks "
                "and bf16 sink chunks, and there are none (--kv-cache-quant-keep-recent 0, sink "
                "packed); raise --kv-cache-quant-keep-recent, pass --kv-cache-quant-sink 0, or "
                "drop the flag"
            )

    def requires(self) -> dict[str, str]:
        return {"quant:qvg": f"--kv-cache-quant {self.codec}"} if self.enabled else {}

    def describe(self) -> str:
        if not self.enabled:
            return "off"
        reads = _reads_of(self.codec)  # the codec's own knobs: said only when it reads them
        said = {"centroids": f"centroids={self.centroids}", "block_size": f"block={self.block_size}",
                "stages": f"stages={self.stages}", "kmeans_iters": f"iters={self.kmeans_iters}",
                "asymmetric": "asym" if self.asymmetric else "sym"}
        parts = [
            self.codec,
            *(text for name, text in said.items() if name in reads),
            f"keep_recent={self.keep_recent_chunks}",
            f"sink={'packed/' + self.sink_span if self.sink else 'bf16'}",
            f"sink_keep={self.sink_keep_chunks}",
        ]
        optional = [("grid" in reads and self.grid != "reference", f"grid={self.grid}"),
                    (self.span_chunks != 1, f"span={self.span_chunks}"),
                    (self.codebook_chunks != 1, f"codebook_chunks={self.codebook_chunks}"),
                    (self.recent_tier != "bf16", f"recent_tier={self.recent_tier}")]
        parts += [text for shown, text in optional if shown]
        return "qvg(" + ", ".join(parts) + ")"

    # ---- the reference runtime's surface ------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Field name -> value (the reference runtime's ``asdict``)."""
        return {n: getattr(self, n) for n in self.specs()}

    @classmethod
    def from_codec_name(cls, name: str | None, **overrides: Any) -> QVGKVQuantArgs:
        """``"off"`` or a codec setting's name (``ConfigError`` otherwise), with field overrides."""
        return replace(cls(), codec=_codec_name(name), **overrides)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> QVGKVQuantArgs:
        """Read the reference runtime's keys (``kv_cache_quant``, ``kv_cache_quant_<field>``)
        and field names; other keys and None values are ignored."""
        keys, specs = cls.keys(), cls.specs()
        names = {keys.get(key, key): value for key, value in d.items() if value is not None}
        return cls(**{n: specs[n].read(v) for n, v in names.items() if n in specs})

