"""`QVGKVQuantArgs`: QVG KV-cache quantization settings, reference-runtime compatible.

Field names, defaults, dict keys and flag names match the reference runtime so configs
carry over. Options beyond the reference keep the reference behaviour by default. Torch-free:
plugin authors and hosts import it without loading torch (``causalkv.caches.qvg.args``
re-exports it). A `QVGKVQuantArgs` validates itself on construction.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from causalkv.errors import ConfigError

__all__ = ["QUANT_CHOICES", "QVGKVQuantArgs", "add_cli_args", "from_namespace"]

QUANT_CHOICES = ("off", "int4", "int2")
_BITS_BY_NAME = {"off": None, "int4": 4, "int2": 2, "none": None, None: None}
_SINK_SPANS = ("chunk", "full")


@dataclass(frozen=True)
class QVGKVQuantArgs:
    """QVG (PRQ) KV-cache quantization settings.

    Attributes:
        bits: residual bits, ``None`` (off), 2 or 4.
        centroids: k-means centroids per (batch, head) per stage (<= 256: ids are uint8).
        block_size: channels per residual quantization block (must divide head_dim).
        stages: residual k-means stages.
        kmeans_iters: Lloyd iterations per stage.
        asymmetric: store a zero point per block (else symmetric codes ``-q..q``).
        keep_recent_chunks: completed chunks kept in bf16 besides the current one.
        sink: quantize the attention sink too (True, the reference default); False keeps
            every chunk that holds sink tokens (stream-start sink or pinned shot sink) in bf16.
        sink_span: how sink chunks are packed when ``sink``: ``"chunk"`` one segment per
            chunk, ``"full"`` the whole sink as one span (one codebook).
        sink_keep_chunks: leading sink chunks kept in bf16 forever.
        grid: 2-bit residual grid: ``"reference"`` (symmetric codes -1..1, scale = absmax,
            or a zero point when asymmetric) or ``"mse4"`` (all four levels
            ``{-1.5,-0.5,0.5,1.5} * s`` with an error-minimizing scale). Beyond the reference.
        span_chunks: cold chunks packed together as one segment (shares the codebook across
            chunks; beyond the reference, 1 = reference behaviour).
        codebook_chunks: consecutive cold chunks that share one k-means codebook, each still
            packed as soon as it is cold: the first runs k-means, the next ones only assign
            to its centroids, which are stored once (beyond the reference, 1 = reference).
    """

    bits: int | None = None
    centroids: int = 128
    block_size: int = 64
    stages: int = 1
    kmeans_iters: int = 2
    asymmetric: bool = False
    keep_recent_chunks: int = 1
    sink: bool = True
    sink_span: str = "chunk"
    sink_keep_chunks: int = 0
    grid: str = "reference"
    span_chunks: int = 1
    codebook_chunks: int = 1

    def __post_init__(self) -> None:
        self.validate()

    @property
    def enabled(self) -> bool:
        return self.bits is not None

    def validate(self) -> QVGKVQuantArgs:
        """Raise `ConfigError` (a ValueError) with the reference runtime's messages; return self."""
        if self.bits is not None and self.bits not in (2, 4):
            raise ConfigError("kv-cache-quant bits must be 2 or 4")
        for name in (
            "centroids", "block_size", "stages", "kmeans_iters", "span_chunks", "codebook_chunks"
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                flag = {"kmeans_iters": "iters"}.get(name, name).replace("_", "-")
                raise ConfigError(f"kv-cache-quant-{flag} must be > 0")
        if self.centroids > 256:
            raise ConfigError(
                f"kv-cache-quant-centroids must be <= 256 (cluster ids are uint8), got {self.centroids}"
            )
        for name in ("keep_recent_chunks", "sink_keep_chunks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                flag = {"keep_recent_chunks": "keep-recent", "sink_keep_chunks": "sink-keep"}[name]
                raise ConfigError(f"kv-cache-quant-{flag} must be >= 0, got {value!r}")
        if self.sink_span not in _SINK_SPANS:
            raise ConfigError(
                f"kv-cache-quant-sink-span must be one of {list(_SINK_SPANS)}, got {self.sink_span!r}"
            )
        if self.grid not in ("reference", "mse4"):
            raise ConfigError(f"kv-cache-quant-grid must be one of ['reference', 'mse4'], got {self.grid!r}")
        if self.bits is not None and (self.block_size * self.bits) % 8:
            raise ConfigError(
                f"kv-cache-quant-block-size {self.block_size} x {self.bits} bits is not a whole "
                f"number of bytes; use a block size divisible by {8 // self.bits}"
            )
        return self

    def layout_problem(self, head_dim: int) -> str | None:
        """Why these settings cannot pack K/V of ``head_dim`` channels, or None when they can.

        Knowable before any weights load (``head_dim`` comes from the model's config): a host
        calls it at start-up, so a bad block size is refused before the first chunk.
        """
        if self.enabled and head_dim % self.block_size:
            divisors = [d for d in range(8 // self.bits, head_dim + 1)
                        if head_dim % d == 0 and (d * self.bits) % 8 == 0]
            return (
                f"kv-cache-quant-block-size {self.block_size} does not divide head_dim={head_dim}; "
                f"choose one of {divisors}"
            )
        return None

    def check_layout(self, head_dim: int) -> QVGKVQuantArgs:
        """Raise `ConfigError` with `layout_problem`'s message when there is one; return self."""
        problem = self.layout_problem(head_dim)
        if problem is not None:
            raise ConfigError(problem)
        return self

    def describe(self) -> str:
        if not self.enabled:
            return "off"
        parts = [
            f"int{self.bits}",
            f"centroids={self.centroids}",
            f"block={self.block_size}",
            f"stages={self.stages}",
            f"iters={self.kmeans_iters}",
            "asym" if self.asymmetric else "sym",
            f"keep_recent={self.keep_recent_chunks}",
            f"sink={'packed/' + self.sink_span if self.sink else 'bf16'}",
            f"sink_keep={self.sink_keep_chunks}",
        ]
        if self.grid != "reference":
            parts.append(f"grid={self.grid}")
        if self.span_chunks != 1:
            parts.append(f"span={self.span_chunks}")
        if self.codebook_chunks != 1:
            parts.append(f"codebook_chunks={self.codebook_chunks}")
        return "qvg(" + ", ".join(parts) + ")"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_bits_name(cls, name: str | None, **overrides: Any) -> QVGKVQuantArgs:
        key = name.lower() if isinstance(name, str) else name
        if key not in _BITS_BY_NAME:
            raise ConfigError(f"kv-cache-quant must be one of {list(QUANT_CHOICES)}, got {name!r}")
        return replace(cls(), bits=_BITS_BY_NAME[key], **overrides).validate()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> QVGKVQuantArgs:
        """Read the reference runtime's keys (``kv_cache_quant``, ``kv_cache_quant_<field>``)."""
        mapping = {
            "kv_cache_quant_centroids": "centroids",
            "kv_cache_quant_block_size": "block_size",
            "kv_cache_quant_stages": "stages",
            "kv_cache_quant_iters": "kmeans_iters",
            "kv_cache_quant_keep_recent": "keep_recent_chunks",
            "kv_cache_quant_sink_keep": "sink_keep_chunks",
            "kv_cache_quant_asymmetric": "asymmetric",
            "kv_cache_quant_sink": "sink",
            "kv_cache_quant_sink_span": "sink_span",
            "kv_cache_quant_grid": "grid",
            "kv_cache_quant_span_chunks": "span_chunks",
            "kv_cache_quant_codebook_chunks": "codebook_chunks",
        }
        names = {f.name for f in fields(cls)}
        kw: dict[str, Any] = {}
        for key, value in d.items():
            if value is None:
                continue
            if key == "kv_cache_quant":
                kw["bits"] = cls.from_bits_name(value).bits if not isinstance(value, int) else value
            elif key in mapping:
                field = mapping[key]
                if field in ("asymmetric", "sink"):
                    value = bool(int(value)) if isinstance(value, (str, int)) else bool(value)
                kw[field] = value
            elif key in names:
                kw[key] = value
        return cls(**kw).validate()


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the reference runtime's ``--kv-cache-quant*`` flags to ``parser``."""
    g = parser.add_argument_group("QVG KV-cache quantization")
    d = QVGKVQuantArgs()
    g.add_argument("--kv-cache-quant", choices=QUANT_CHOICES, default="off",
                   help="quantize cold KV-cache chunks with QVG/PRQ (default: off)")
    g.add_argument("--kv-cache-quant-centroids", type=int, default=d.centroids,
                   help=f"k-means centroids per head per stage, <= 256 (default: {d.centroids})")
    g.add_argument("--kv-cache-quant-block-size", type=int, default=d.block_size,
                   help=f"channels per residual scale block (default: {d.block_size})")
    g.add_argument("--kv-cache-quant-stages", type=int, default=d.stages,
                   help=f"residual k-means stages (default: {d.stages})")
    g.add_argument("--kv-cache-quant-iters", type=int, default=d.kmeans_iters,
                   help=f"k-means iterations per stage (default: {d.kmeans_iters})")
    g.add_argument("--kv-cache-quant-keep-recent", type=int, default=d.keep_recent_chunks,
                   help=f"completed chunks kept in bf16 (default: {d.keep_recent_chunks})")
    g.add_argument("--kv-cache-quant-sink-keep", type=int, default=d.sink_keep_chunks,
                   help=f"leading sink chunks kept in bf16 forever (default: {d.sink_keep_chunks})")
    g.add_argument("--kv-cache-quant-asymmetric", action="store_true",
                   help="store a zero point per residual block")
    g.add_argument("--kv-cache-quant-sink", type=int, choices=(0, 1), default=1,
                   help="1: quantize the attention sink too; 0: keep sink chunks in bf16 (default: 1)")
    g.add_argument("--kv-cache-quant-sink-span", choices=_SINK_SPANS, default=d.sink_span,
                   help="pack the sink per chunk (chunk) or as one span (full) (default: chunk)")
    g.add_argument("--kv-cache-quant-grid", choices=("reference", "mse4"), default=d.grid,
                   help="2-bit residual grid (beyond the reference; default: reference)")
    g.add_argument("--kv-cache-quant-span-chunks", type=int, default=d.span_chunks,
                   help="cold chunks packed as one segment sharing a codebook (default: 1)")
    g.add_argument("--kv-cache-quant-codebook-chunks", type=int, default=d.codebook_chunks,
                   help="consecutive cold chunks sharing one k-means codebook, each packed "
                        "when cold (beyond the reference; default: 1)")
    return parser


def from_namespace(ns: argparse.Namespace) -> QVGKVQuantArgs:
    """Build validated args from a namespace parsed with `add_cli_args`."""
    return QVGKVQuantArgs.from_dict({k: v for k, v in vars(ns).items() if k.startswith("kv_cache_quant")})
