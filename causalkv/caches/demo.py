"""The cache walkthrough behind ``causalkv demo``: a LongLive-2.0-like stream through the dense cache.

No model and no weights: each chunk is written the way a causal stage writes one layer's
cache (4 denoising steps, the first advancing, then a context pass rewriting the clean
K/V: 5 writes per chunk), and a scene-cut chunk is pinned as the shot sink after its
context pass. Per chunk the demo prints what attention saw (position ranges), whether the
chunk was pinned, the pinned range, the resident bytes and a one-character-per-frame map.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from causalkv.caches.intervals import describe

if TYPE_CHECKING:
    from causalkv.caches.spec import CausalCacheSpec

#: the bytes as the report prints them (``causalkv demo`` passes the planner's binary units)
SizeFormat = Callable[[int], str]

__all__ = ["ChunkReport", "DemoConfig", "format_report", "run_demo"]

FORWARDS_PER_CHUNK = 5  # 4 denoising steps + the context pass


@dataclass(frozen=True)
class DemoConfig:
    """LongLive 2.0 in miniature (8-frame chunks, 8-frame global sink, 8-frame
    shot sink, 32-frame window), with ``tokens_per_frame`` instead of 880."""

    chunks: int = 9
    tokens_per_frame: int = 2
    frames_per_chunk: int = 8
    sink_frames: int = 8
    window_frames: int = 32
    cuts: tuple[int, ...] = (3, 6)
    num_heads: int = 4
    head_dim: int = 8

    @property
    def chunk_tokens(self) -> int:
        return self.frames_per_chunk * self.tokens_per_frame

    def spec(self) -> CausalCacheSpec:
        # the walkthrough imports torch; its config (``demo --help``) does not
        from causalkv.caches.spec import CausalCacheSpec

        sink = self.sink_frames * self.tokens_per_frame
        return CausalCacheSpec(  # bf16, the spec's default dtype
            batch_size=1,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            cache_size=self.window_frames * self.tokens_per_frame,
            sink_tokens=sink,
            global_sink_tokens=sink,
        )


@dataclass(frozen=True)
class ChunkReport:
    """What one chunk's context pass saw."""

    written: tuple[int, int]
    visible: tuple[tuple[int, int], ...]
    pinned_here: bool
    shot_sink_seen: tuple[int, int] | None  # the shot sink in place while the chunk was written
    pinned: tuple[int, int] | None  # the shot sink after this chunk
    retained: tuple[tuple[int, int], ...]
    resident_nbytes: int


def run_demo(config: DemoConfig) -> list[ChunkReport]:
    """Drive a `DenseCausalKVCache` through the stream; one report per chunk."""
    import torch

    from causalkv.caches.dense import DenseCausalKVCache

    spec = config.spec()
    cache = DenseCausalKVCache(spec)
    n = config.chunk_tokens
    reports = []
    for c in range(config.chunks):
        start = c * n
        # K/V [B, n, H, D]; the value is irrelevant to the positions, so use the chunk index
        kv = torch.full((1, n, spec.num_heads, spec.head_dim), float(c % 256), dtype=spec.dtype)
        for _ in range(FORWARDS_PER_CHUNK):
            view = cache.update_and_get_attention_kv(
                key=kv, value=kv, current_chunk_start=start, debug_name="demo.block0"
            )
        seen_pin = cache.state.pinned
        cut = c in config.cuts
        if cut:
            cache.pin_current_chunk(n)
        reports.append(
            ChunkReport(
                written=(start, start + n),
                visible=view.position_ranges,
                pinned_here=cut,
                shot_sink_seen=seen_pin,
                pinned=cache.state.pinned,
                retained=cache.state.retained,
                resident_nbytes=cache.resident_nbytes(),
            )
        )
    return reports


def _frame_map(r: ChunkReport, config: DemoConfig, total_frames: int) -> str:
    """One character per frame after the chunk's context pass: G global sink, P pinned shot
    sink (the chunk itself when it is a scene cut, pinned after its context pass), C current
    chunk, # other visible, r retained but not visible, . evicted, blank not yet written."""
    sink_end = config.sink_frames * config.tokens_per_frame
    shot = [r.written] * r.pinned_here + ([r.shot_sink_seen] if r.shot_sink_seen is not None else [])

    def char(p: int) -> str:
        if p >= r.written[1]:
            return " "
        if not _inside(p, r.visible):
            return "r" if _inside(p, r.retained) else "."
        if p < sink_end:
            return "G"
        return "P" if _inside(p, shot) else "C" if _inside(p, [r.written]) else "#"

    return "".join(char(f * config.tokens_per_frame) for f in range(total_frames))


def _inside(p: int, runs: Sequence[tuple[int, int]]) -> bool:
    return any(a <= p < b for a, b in runs)


def format_report(config: DemoConfig, reports: Sequence[ChunkReport], size: SizeFormat) -> str:
    """The walkthrough's text; ``size`` formats every byte count (binary units)."""
    spec = config.spec()
    tpf = config.tokens_per_frame
    total_frames = config.chunks * config.frames_per_chunk
    lines = [
        "causalkv demo: a LongLive-2.0-like stream through DenseCausalKVCache (no model)",
        f"  spec: B={spec.batch_size} heads={spec.num_heads} head_dim={spec.head_dim} "
        f"{str(spec.dtype).removeprefix('torch.')}, {tpf} tokens/frame, "
        f"chunk {config.frames_per_chunk} frames = {config.chunk_tokens} tokens",
        f"  global sink {spec.global_sink_tokens} tokens, shot sink {spec.sink_tokens} tokens, "
        f"window = cache_size {spec.cache_size} tokens; {FORWARDS_PER_CHUNK} writes per chunk "
        "(4 steps + context pass)",
        "  scene cuts (pinned after their context pass): chunks "
        + (", ".join(str(c) for c in config.cuts) or "none"),
        "",
        f"{'chunk':>5}  {'written':<10} {'pin':<3}  {'visible positions':<30} "
        f"{'visible':>7}  {'shot sink':<10} {'resident':>10}",
    ]
    for i, r in enumerate(reports):
        visible = sum(b - a for a, b in r.visible)
        pinned = describe((r.pinned,)) if r.pinned is not None else "-"
        lines.append(
            f"{i:>5}  {describe((r.written,)):<10} {'pin' if r.pinned_here else '':<3}  "
            f"{describe(r.visible):<30} {visible:>7}  {pinned:<10} "
            f"{size(r.resident_nbytes):>10}"
        )
    lines += ["", f"frame map (1 char = 1 frame = {tpf} tokens), after each chunk's context pass:"]
    maps = [_frame_map(r, config, total_frames) for r in reports]
    lines += [f"{i:>5}  |{m}|" for i, m in enumerate(maps)]
    held = "  r held but outside the window" if any("r" in m for m in maps) else ""
    lines += [
        "  G global sink  P pinned shot sink (a cut chunk: pinned after its context pass)",
        "  C current chunk  # rolling window (visible)",
        f"{held}  . evicted",
        "",
        "The cache is preallocated ([B, cache_size, H, D] for K and for V), so the resident",
        "bytes stay constant; a later cut releases the earlier shot sink, which then rolls out.",
        full_scale_line(config, size),
    ]
    return "\n".join(lines)


def full_scale_line(config: DemoConfig, size: SizeFormat) -> str:
    """The same window at LongLive 2.0 scale: 880 tokens/frame, 30 layers x 24 heads x 128, bf16."""
    from causalkv.caches.spec import CausalCacheSpec

    tokens = config.window_frames * 880
    per_layer = CausalCacheSpec(1, 24, 128, tokens).dense_nbytes()  # bf16, the default dtype
    total = 30 * per_layer
    return (
        f"At LongLive 2.0 scale (880 tokens/frame, 30 layers x 24 heads x 128, bf16) this "
        f"{config.window_frames}-frame cache holds {tokens:,} tokens: {size(total)} of K/V "
        f"({total // tokens:,} B per token)."
    )
