"""The planner's records: the settings it tabulates, the request, the stream layout, byte units."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from causalkv.caches.codecs import codec_names, codec_setting
from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.errors import ConfigError, check_int, is_int

if TYPE_CHECKING:
    from causalkv.caches.positions import PositionModel
    from causalkv.caches.qvg.policy import PackingPolicy

#: how a call's attention reads the window it sees: ``gathered`` into one dense buffer
#: (sglang's attention reads the view's ``k``/``v``: the bridge's default) or ``streamed``, one
#: packed segment decoded at a time (`causalkv.caches.attend`: causalkv generate's attention)
ATTENTION = ("gathered", "streamed")


@dataclass(frozen=True)
class CacheModel:
    """The cache a plan counts (`causalkv.memory.cache_models` has the planned ones).

    Attributes:
        positions: the cursor model deciding which positions a layer holds and shows
            (`causalkv.caches.positions.PositionModel`: ``StreamState``, ``RollingSlots``).
        policy: which completed chunks stay dense (a `PackingPolicy`: ``RECENT_CHUNKS``,
            ``RECENT_NON_SINK``).
        min_tokens_per_centroid: the centroid rule's ``m`` (`centroids_for`); None packs
            with the settings' centroids as given.
        attention: how a call reads its window unless the request says (`ATTENTION`).
        lazy_views: a view builds its window buffer when read (or when made, if nothing
            packed is visible), `causalkv.caches.CausalAttentionKVView`; False: every call
            gathers its window into one dense buffer after its write.
    """

    positions: type[PositionModel]
    policy: PackingPolicy
    min_tokens_per_centroid: int | None
    attention: str
    lazy_views: bool


def attention_of(cache: CacheModel, attention: str | None) -> str:
    """``attention`` checked (`ConfigError`), or the cache's own way when None."""
    if attention is None:
        return cache.attention
    if attention not in ATTENTION:
        raise ConfigError(f"--attention must be one of {list(ATTENTION)}, got {attention!r}")
    return attention


# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    """One QVG setting of the planner's table (the benchmark's names).

    Attributes:
        name: the row's name.
        codec: the codec setting (``"int2"``, ``"fp8"``, ...; None: quantization off).
        keep_recent_chunks: completed chunks the recency guard keeps out of the main codec.
        recent_tier: ``"bf16"`` (the chunks the policy keeps dense stay bf16) or a codec
            setting (the ones it keeps for recency, or as sinks with ``sink=0``, are packed
            with it).
        help: one line for ``--help``.
        sink: the row's own ``--kv-cache-quant-sink`` (None: the request's).
    """

    name: str
    codec: str | None
    keep_recent_chunks: int = 1
    recent_tier: str = "bf16"
    help: str = ""
    sink: bool | None = None

    def quant_args(self, *, sink: bool = True) -> QVGKVQuantArgs:
        """The cache's settings record (sglang's defaults for everything the row does not set:
        128 centroids, block 64, 1 stage, symmetric; ``sink`` unless the row sets its own)."""
        if self.codec is None:
            return QVGKVQuantArgs()
        return QVGKVQuantArgs(codec=self.codec, keep_recent_chunks=self.keep_recent_chunks,
                              sink=sink if self.sink is None else self.sink, recent_tier=self.recent_tier)


#: the rows every registered codec setting gets, in table order: (name suffix, completed chunks
#: the recency guard keeps out of the codec, what the row is)
VARIANTS: tuple[tuple[str, int, str], ...] = (
    ("default", 1, "sglang's defaults (keep-recent 1, sink packed)"),
    ("recent0", 0, "keep-recent 0 (every context chunk packed)"),
)

#: the benchmark's study rows (benchmarks/sglang_bridge.py), each after its codec's `VARIANTS`
#: rows while every codec it names is registered
STUDIES: tuple[Setting, ...] = (
    Setting("int2-recent-int4", "int2", 1, "int4",
            help="int2, keep-recent 1 with the recent chunk held at int4 (recent tier int4)"),
    Setting("int2-recent-fp8", "int2", 1, "fp8",
            help="int2, keep-recent 1 with the recent chunk held at fp8 (recent tier fp8)"),
    Setting("int2-sink0", "int2", 1, sink=False,
            help="int2, sglang's defaults but --kv-cache-quant-sink 0: the sink and the "
            "pinned shot sink bf16"),
)

_OFF = Setting("off", None, help="the QVG cache with quantization off: every context chunk bf16 "
               "(the benchmark's row; a run with --kv-cache-quant off keeps the dense cache, "
               "dense_bytes)")


def settings() -> dict[str, Setting]:
    """The planner's rows, in table order, from the codec registry as it is now
    (`causalkv.caches.codecs`: causalkv's codec settings, then each loaded plugin's, registered
    alike): ``off``, then per codec setting its `VARIANTS` rows (``<codec>-default``,
    ``<codec>-recent0``) and its `STUDIES` rows. A script loads its plugins' codecs first with
    `causalkv.plugin.collect` (the ``causalkv`` command does before it builds its parsers)."""
    names = codec_names()
    rows = [_OFF]
    for codec in names:
        about = codec_setting(codec).help
        for i, (suffix, keep, what) in enumerate(VARIANTS):  # the first row says what it is
            named = f"{codec} ({about})" if about and i == 0 else codec
            rows.append(Setting(f"{codec}-{suffix}", codec, keep, help=f"{named}, {what}"))
        rows += [s for s in STUDIES if s.codec == codec and s.recent_tier in ("bf16", *names)]
    return {s.name: s for s in rows}


class _Rows(Mapping[str, Setting]):
    """`settings()` as a mapping read at each use, so a codec registered later has its rows."""

    def __getitem__(self, name: str) -> Setting:
        return settings()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(settings())

    def __len__(self) -> int:
        return len(settings())


#: the planner's rows by name, in table order (`settings()`; names shared with
#: benchmarks/sglang_bridge.py): read at each use, so a plugin's codec loaded later has its rows
SETTINGS: Mapping[str, Setting] = _Rows()


@dataclass(frozen=True)
class MemoryRequest:
    """One request, as the planner sees it.

    Attributes:
        height, width: video size in pixels (None: the model's).
        frames: video frames (sglang's ``--num-frames``); or ``latent_frames``; or
            ``seconds`` at ``fps`` (at most one of the three; none: the model's default).
        cfg: classifier-free guidance on (a second cache set, the negative branch's).
        shots: shots (LongLive 2.0: each after the first starts with a pinned cut chunk).
        batch_size: B of the caches.
        dtype: the KV dtype (what sglang's dense cache and the bf16 tier store).
        window_frames: a window override in latent frames (None: the model's).
        sink: ``--kv-cache-quant-sink``: pack sink chunks (True, sglang's default) or keep
            them bf16 (or at the recent tier, ``int2-recent-int4``).
        attention: how a call reads its window (`ATTENTION`; None: the cache's way,
            `CacheModel.attention`).
    """

    height: int | None = None
    width: int | None = None
    frames: int | None = None
    latent_frames: int | None = None
    seconds: float | None = None
    fps: int | None = None
    cfg: bool = False
    shots: int = 1
    batch_size: int = 1
    dtype: str = "bfloat16"
    window_frames: int | None = None
    sink: bool = True
    attention: str | None = None


@dataclass(frozen=True)
class StreamLayout:
    """A request's stream in tokens: what the position bookkeeping runs on.

    Attributes:
        tokens_per_frame, frames_per_chunk, chunk_tokens: chunk geometry.
        num_chunks: chunks of the request.
        latent_frames, video_frames: the request's length.
        sink_tokens, global_sink_tokens, cache_tokens: one layer's cache (``cache_tokens`` =
            the window: sglang's cache size).
        pins: indices of the chunks pinned as shot sinks after their context pass.
        sets: cache sets (2 with CFG).
        height, width: pixels.
    """

    tokens_per_frame: int
    frames_per_chunk: int
    num_chunks: int
    latent_frames: int
    video_frames: int
    sink_tokens: int
    global_sink_tokens: int
    cache_tokens: int
    window_frames: int
    pins: frozenset[int]
    sets: int
    height: int
    width: int

    @property
    def chunk_tokens(self) -> int:
        return self.tokens_per_frame * self.frames_per_chunk


#: byte units by lower-case name: ``kb`` ... ``tb`` powers of 1000, ``kib`` ... ``tib`` and
#: ``k`` ... ``t`` powers of 1024
_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgt", 1):
    _UNITS.update({f"{_p}b": 10 ** (3 * _i), f"{_p}ib": 2 ** (10 * _i), _p: 2 ** (10 * _i)})


def parse_bytes(text: str | int, what: str = "--budget") -> int:
    """``"80GiB"``, ``"80 GB"``, ``"1.5TiB"``, ``"85899345920"`` -> bytes (`ConfigError` otherwise).

    GiB/MiB/KiB/TiB (and G/M/K/T) are powers of 1024, GB/MB/KB/TB powers of 1000.
    """
    if is_int(text, None):
        value, unit = float(text), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
        if m is None or m.group(2).lower() not in _UNITS:
            raise ConfigError(
                f"{what} {text!r} is not a size; pass a number with a unit such as 80GiB, "
                "80GB, 512MiB (GiB = 2^30 bytes, GB = 10^9) or a plain byte count"
            )
        value, unit = float(m.group(1)), m.group(2).lower()
    nbytes = value * _UNITS[unit]
    if not math.isfinite(nbytes) or nbytes < 1:
        raise ConfigError(f"{what} {text!r} must be at least 1 byte; pass e.g. 80GiB")
    return int(nbytes)


def check_budget(budget: int | None) -> int | None:
    """``budget`` if it is None (no budget) or a positive int of bytes; `ConfigError` naming
    ``--budget``, the value and an example otherwise (the planner's and vLLM-Omni's admission
    check: `parse_bytes` reads the flag's text)."""
    if budget is not None:
        check_int("--budget", budget, minimum=1, hint="pass e.g. 80GiB")
    return budget


def format_bytes(n: int) -> str:
    """``n`` bytes in binary units (``"19.33 GiB"``)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def format_columns(rows: Sequence[Sequence[str]]) -> list[str]:
    """``rows`` as aligned lines: the first column left-aligned, the others right-aligned, two
    spaces apart (``causalkv memory``'s table, ``causalkv generate --compare-bf16``'s)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
            for row in rows]
