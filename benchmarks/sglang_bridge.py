"""sglang's KV caches and the causalkv bridge's, per attention call, side by side in one run.

Runs in the sglang environment only (it imports sglang 0.5.23's caches): build it with
``make venv-sglang``, then

    .venv-sglang/bin/python benchmarks/sglang_bridge.py [--heads 2] [--chunks 12] [--threads 1] [--json]
    .venv-sglang/bin/python benchmarks/sglang_bridge.py --device cuda     # on a GPU

A LongLive 2.0 stream at its real geometry (7,040 tokens per 8-frame chunk, an 8-frame
global sink and shot sink, a 32-frame window = 4 chunks = the cache, head_dim 128; heads
reduced, ``--heads``), ``--chunks`` chunks of 5 passes each (4 denoising steps and the
context update, every pass one ``update_and_get_attention_kv`` as sglang's attention layer
makes it), a scene cut pinned after chunk ``--pin``. The same K/V (`benchmarks/cache.py`'s
structured `StreamKV`) go into:

- ``sglang dense``: sglang's ``CausalSelfAttentionKVCache`` (the baseline of every ratio);
- ``sglang QVG``: sglang's own ``QVGPackedCausalKVCache``. Without CUDA it runs only with
  quantization off (its codec is quant-videogen's CUDA kernels); it refuses pins and global
  sinks, so its stream has neither. With ``--device cuda`` and quant-videogen importable it
  also runs at int4 and int2;
- ``bridge int4`` / ``bridge int2``: causalkv's ``SGLangQVGKVCache`` (sglang's defaults:
  128 centroids, block 64, keep-recent 1, sink packed), global sink and pin included.

Per cache: time per call (mean over every call of a stream; a warm-up stream first, then the
least of ``--repeat`` streams, which filters out other processes on a shared machine) and
per advance (the calls that also evict and pack); peak transient bytes, i.e. the most
memory allocated during one call above what was allocated before it, the returned view
included (on the CPU from torch.profiler's record of every allocation and free, on CUDA
``torch.cuda.max_memory_allocated``), over every call and over the rewrite calls alone;
resident KV bytes (the largest over the stream); the relative L2 error of the last view's K
against sglang dense (same positions: the bridge's views are sglang's views). Ratios are to
sglang dense in the same run. The attention math is the same for every cache and is not in
the per-call figures; one torch SDPA over a full window (the chunk's queries against the
window's keys, bf16) is timed once and printed for scale. On the CPU the PRQ codec keeps a
per-thread workspace between calls (tile-sized buffers, allocated once): not transient, it
is reported on its own line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "demo" / "sglang" / "cpu_stand_ins"))

try:  # the registry's torchvision for torch 2.13 needs the CPU stand-in (docs/sglang.md) on a CPU
    import tvshim

    tvshim.install()
    from sglang.multimodal_gen.configs.quantization.qvg_kv import QVGKVQuantArgs
    from sglang.multimodal_gen.runtime.layers.kvcache.causal_attention_cache import (
        CausalSelfAttentionKVCache,
    )
    from sglang.multimodal_gen.runtime.layers.kvcache.qvg_packed_cache import (
        QVGPackedCausalKVCache,
    )
except ImportError as exc:  # pragma: no cover - the message is the point
    raise SystemExit(
        f"benchmarks/sglang_bridge.py needs the sglang environment ({exc}); run "
        "`make venv-sglang` and use .venv-sglang/bin/python"
    ) from exc

from cache import StreamKV  # noqa: E402  (benchmarks/cache.py: the structured K/V)

from causalkv.caches.passes import PassMarker  # noqa: E402
from causalkv.caches.qvg.options import QVGKVQuantArgs as CausalKVQuant  # noqa: E402
from causalkv.sglang.cache import SGLangQVGKVCache  # noqa: E402
from causalkv.sglang.settings import EnvSettings, bridge_args  # noqa: E402


@dataclass(frozen=True)
class Geometry:
    tokens_per_frame: int = 880
    frames_per_chunk: int = 8
    sink_frames: int = 8
    window_frames: int = 32
    heads: int = 2
    head_dim: int = 128
    chunks: int = 12
    passes: int = 5
    pin_after: int = 6

    @property
    def chunk(self) -> int:
        return self.tokens_per_frame * self.frames_per_chunk

    @property
    def sink(self) -> int:
        return self.tokens_per_frame * self.sink_frames

    @property
    def cache(self) -> int:
        return self.tokens_per_frame * self.window_frames


QUICK = Geometry(tokens_per_frame=32, chunks=6, pin_after=2, heads=2, head_dim=64)


def _indices(device):
    return dict(global_end_index=torch.zeros(1, dtype=torch.long, device=device),
                local_end_index=torch.zeros(1, dtype=torch.long, device=device))


def make_caches(g: Geometry, device: torch.device) -> dict[str, tuple[Callable[[], object], bool]]:
    """name -> (factory, serves pins and the global sink)."""
    dt = torch.bfloat16
    shape = (1, g.cache, g.heads, g.head_dim)
    common = dict(batch_size=1, cache_size=g.cache, num_heads=g.heads, head_dim=g.head_dim,
                  dtype=dt, device=device, sink_tokens=g.sink, attention_window_size=g.cache)

    def dense():
        return CausalSelfAttentionKVCache(
            k=torch.zeros(shape, dtype=dt, device=device), v=torch.zeros(shape, dtype=dt, device=device),
            **_indices(device), cache_size=g.cache, sink_tokens=g.sink,
            attention_window_size=g.cache, global_sink_tokens=g.sink)

    def sglang_qvg(bits):
        return lambda: QVGPackedCausalKVCache(**common, **_indices(device),
                                              quant_args=QVGKVQuantArgs(bits=bits))

    def bridge(bits, marked=False):
        return lambda: SGLangQVGKVCache(**common, **_indices(device), global_sink_tokens=g.sink,
                                        quant_args=QVGKVQuantArgs(bits=bits),
                                        marker=PassMarker() if marked else None)

    out = {"sglang dense": (dense, True), "sglang QVG off": (sglang_qvg(None), False)}
    if device.type == "cuda":
        out["sglang QVG int4"] = (sglang_qvg(4), False)
        out["sglang QVG int2"] = (sglang_qvg(2), False)
    out["bridge int4"] = (bridge(4), True)
    out["bridge int2"] = (bridge(2), True)
    # as sglang's served stages run it now: the denoising passes are probes (nothing stored),
    # the context update commits (the chunk packed there, not at the advance)
    out["bridge int4, probe + commit"] = (bridge(4, True), True)
    out["bridge int2, probe + commit"] = (bridge(2, True), True)
    return out


def resident(cache) -> int:
    if isinstance(cache, CausalSelfAttentionKVCache):
        return cache.k.nbytes + cache.v.nbytes
    return int(cache.resident_nbytes())


class Peak:
    """Peak bytes allocated during a call above the start (the call's result kept alive)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, fn: Callable[[], object]) -> tuple[int, object]:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = fn()
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - start, out
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = fn()
        events = sorted((e for e in prof.events() if e.self_cpu_memory_usage),
                        key=lambda e: e.time_range.start)
        run = top = 0
        for e in events:
            run += e.self_cpu_memory_usage
            top = max(top, run)
        return top, out


def stream(g: Geometry, factory, pins: bool, data, device, *, measure=None):
    """One stream through a fresh cache: per call (advance?, seconds, peak bytes), the
    largest resident bytes, the last view's K."""
    cache = factory()
    calls, top_resident, view = [], 0, None
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    marker = getattr(cache, "marker", None)
    for c in range(g.chunks):
        k, v = data[c]
        for p in range(g.passes):
            def call(k=k, v=v, c=c, p=p):
                if marker is None:
                    scope = contextlib.nullcontext()
                elif p < g.passes - 1:
                    scope = marker.probing()
                else:
                    scope = marker.committing(pin=pins and c == g.pin_after)
                with scope:
                    return cache.update_and_get_attention_kv(
                        key=k, value=v, current_chunk_start=c * g.chunk, debug_name="bench")
            if measure is None:
                sync()
                t0 = time.perf_counter()
                view = call()
                sync()
                calls.append((p == 0, time.perf_counter() - t0, 0))
            else:
                peak, view = measure(call)
                calls.append((p == 0, 0.0, peak))
            top_resident = max(top_resident, resident(cache))
        if pins and c == g.pin_after:
            cache.pin_current_chunk(g.chunk)
    return calls, top_resident, view.k


def attention_seconds(g: Geometry, device: torch.device) -> float:
    """One torch SDPA of a chunk's queries over a full window (bf16), for scale."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, g.heads, g.chunk, g.head_dim, generator=gen).to(device, torch.bfloat16)
    kv = torch.randn(1, g.heads, g.cache, g.head_dim, generator=gen).to(device, torch.bfloat16)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sdpa(q[:, :, :16], kv[:, :, :64], kv[:, :, :64])  # warm-up (kernel selection)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    sdpa(q, kv, kv)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def codec_workspace_bytes() -> int:
    """Bytes of the PRQ codec's per-thread CPU workspace (kept between calls)."""
    from causalkv.caches.codecs.prq import workspace

    bufs = workspace.WORKSPACE.__dict__.get("bufs", {})
    return sum(b.nbytes for b in bufs.values())


def run(g: Geometry, device: torch.device, repeat: int = 3) -> dict:
    kv = StreamKV(heads=g.heads, head_dim=g.head_dim)
    data = [(kv.chunk(c, g.chunk, 0).to(device), kv.chunk(c, g.chunk, 1).to(device))
            for c in range(g.chunks)]
    rows, base_k = [], None
    caches = make_caches(g, device)
    # the timed streams interleave the caches (each repeat streams every cache once), so a
    # load that comes and goes on a shared machine falls on all of them alike
    timed_by: dict[str, list] = {name: [] for name in caches}
    failed: dict[str, str] = {}
    for name, (factory, pins) in caches.items():
        try:
            stream(g, factory, pins, data, device)  # warm-up (allocator, codec workspace)
        except (ImportError, NotImplementedError, AssertionError, RuntimeError) as exc:
            failed[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
    for _ in range(repeat):
        for name, (factory, pins) in caches.items():
            if name not in failed:
                timed_by[name].append(stream(g, factory, pins, data, device))
    for name, (factory, pins) in caches.items():
        row: dict = {"cache": name, "pin_and_global_sink": pins}
        try:
            if name in failed:
                raise RuntimeError(failed[name])
            timed = timed_by[name]
            calls, top, last_k = min(timed, key=lambda r: sum(t for _, t, _ in r[0]))
            adv = min(sum(t for a, t, _ in r[0] if a) / sum(a for a, _, _ in r[0]) for r in timed)
            mem, _, _ = stream(g, factory, pins, data, device, measure=Peak(device))
        except (ImportError, NotImplementedError, AssertionError, RuntimeError) as exc:
            row["unavailable"] = failed.get(name) or f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
            rows.append(row)
            continue
        row.update(
            s_per_call=sum(t for _, t, _ in calls) / len(calls),
            s_per_advance=adv,
            peak_transient_bytes=max(m for _, _, m in mem),
            peak_transient_rewrite_bytes=max(m for a, _, m in mem if not a),
            resident_kv_bytes=top,
        )
        if name == "sglang dense":
            base_k = last_k
        elif pins and base_k is not None:
            row["k_rel_err"] = float((last_k.float() - base_k.float()).norm() / base_k.float().norm())
        rows.append(row)
    base = rows[0]
    for row in rows:
        if "unavailable" in row:
            continue
        for key in ("s_per_call", "peak_transient_bytes", "resident_kv_bytes"):
            row[key + "_vs_dense"] = row[key] / base[key] if base[key] else None
    return {
        "geometry": {**g.__dict__, "chunk_tokens": g.chunk, "cache_tokens": g.cache},
        "device": str(device), "threads": torch.get_num_threads(), "repeat": repeat,
        "load_average": os.getloadavg(), "rows": rows,
        "codec_cpu_workspace_bytes": codec_workspace_bytes() if device.type == "cpu" else 0,
        "sdpa_full_window_s": attention_seconds(g, device),
    }


def _ratio(x) -> str:
    return "—" if x is None else f"{x:.2f}x"


def table(result: dict) -> str:
    g = result["geometry"]
    lines = [
        f"LongLive 2.0 geometry on {result['device']}: {g['chunk_tokens']:,} tokens/chunk, "
        f"sink = global sink = 1 chunk, cache = window = {g['cache_tokens']:,} tokens, "
        f"{g['heads']} heads x {g['head_dim']}, {g['chunks']} chunks x {g['passes']} passes, "
        f"pin after chunk {g['pin_after']}; load average "
        + ", ".join(f"{x:.1f}" for x in result["load_average"]),
        "| cache | ms/call | vs dense | ms/advance | peak transient B | vs dense | "
        "peak transient B, rewrite calls | resident KV B | vs dense | K rel. err |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        name = r["cache"] + ("" if r["pin_and_global_sink"] else " (no pin, no global sink)")
        if "unavailable" in r:
            lines.append(f"| {name} | unavailable: {r['unavailable']} |")
            continue
        err = f"{r['k_rel_err']:.3f}" if "k_rel_err" in r else "—"
        lines.append(
            f"| {name} | {1e3 * r['s_per_call']:.2f} | {_ratio(r['s_per_call_vs_dense'])} | "
            f"{1e3 * r['s_per_advance']:.2f} | {r['peak_transient_bytes']:,} | "
            f"{_ratio(r['peak_transient_bytes_vs_dense'])} | {r['peak_transient_rewrite_bytes']:,} | "
            f"{r['resident_kv_bytes']:,} | {_ratio(r['resident_kv_bytes_vs_dense'])} | {err} |"
        )
    lines.append(
        f"for scale: one torch SDPA over the full window takes "
        f"{1e3 * result['sdpa_full_window_s']:.1f} ms here; the codec's CPU workspace "
        f"(kept between calls, not in the transient figures) is "
        f"{result['codec_cpu_workspace_bytes']:,} B per thread"
    )
    return "\n".join(lines)


# ---- the whole request, all layers (``--layers``) -------------------------------------------
@dataclass(frozen=True)
class ModelGeometry:
    """One model's cache at its real geometry (heads reduced: every byte scales with them)."""

    name: str
    layers: int
    tokens_per_frame: int
    frames_per_chunk: int
    sink_frames: int
    window_frames: int
    heads: int = 2
    head_dim: int = 128
    pin_after: int | None = None  # LongLive 2.0: a shot pinned after this chunk

    @property
    def chunk(self) -> int:
        return self.tokens_per_frame * self.frames_per_chunk

    @property
    def cache(self) -> int:
        return self.tokens_per_frame * self.window_frames

    @property
    def chunks(self) -> int:
        """Enough for the steady state: the window full, rolled twice."""
        return self.window_frames // self.frames_per_chunk + 2


MODELS = {
    # sglang 0.5.23's LongLive 2.0 (704x1280): 30 x 24 x 128, 880 tokens/frame, 8-frame chunks,
    # an 8-frame global sink and shot sink, a 32-frame window = 4 chunk slots
    "longlive2": ModelGeometry("longlive2", 30, 880, 8, 8, 32, pin_after=2),
    # LingBot-World (480x832): 40 x 40 x 128, 1560 tokens/frame, 3-frame chunks, sink 3, the
    # 12-frame cache of its sink-3 config
    "lingbot": ModelGeometry("lingbot", 40, 1560, 3, 3, 12),
    # Self-Forcing Wan 1.3B (480x832): 30 x 12 x 128, 3-frame chunks, no sink, 21 frames
    "self-forcing": ModelGeometry("self-forcing", 30, 1560, 3, 0, 21),
}
#: what the test runs: 3 layers, 512-token chunks (int2 packing pays), 4 slots, a pin
QUICK_MODEL = ModelGeometry("longlive2", 3, 256, 2, 2, 8, heads=1, head_dim=64, pin_after=2)


@dataclass(frozen=True)
class BridgeSetting:
    """A ``--layers`` row as a user asks sglang for it: sglang's QVG flags (its
    ``QVGKVQuantArgs`` fields; sglang's defaults for the rest) and causalkv's environment
    settings (``CAUSALKV_SGLANG_CODEC``, ``CAUSALKV_SGLANG_RECENT_TIER``), turned into the
    cache's settings by the bridge's own conversion (`causalkv.sglang.settings.bridge_args`)."""

    flags: tuple[tuple[str, object], ...] = ()
    env: EnvSettings = EnvSettings()

    def quant(self) -> CausalKVQuant:
        return bridge_args(QVGKVQuantArgs(**dict(self.flags)), self.env)

    def command(self) -> str:
        """The flags and variables that ask for this row (``sglang generate`` and its env)."""
        words = [f"{k}={v}" for k, v in (("CAUSALKV_SGLANG_CODEC", self.env.codec),
                                        ("CAUSALKV_SGLANG_RECENT_TIER", self.env.recent_tier))
                 if v is not None and v != "bf16"]
        for name, value in self.flags:
            flag = _FLAGS[name]
            words.append(f"{flag} {f'int{value}' if name == 'bits' else int(value)}")
        return " ".join(words) or "--kv-cache-quant off"


#: sglang's flag of each QVGKVQuantArgs field the rows set (sglang's server_args)
_FLAGS = {"bits": "--kv-cache-quant", "keep_recent_chunks": "--kv-cache-quant-keep-recent",
          "sink": "--kv-cache-quant-sink"}


def _bits(bits: int, **flags: object) -> tuple[tuple[str, object], ...]:
    return (("bits", bits), *flags.items())


#: setting -> the sglang flags and causalkv settings of the row (fp8 and nvfp4: causalkv's
#: codecs, through CAUSALKV_SGLANG_CODEC while sglang's --kv-cache-quant int4 turns QVG on)
SETTINGS = {
    "off": BridgeSetting(),
    "int2-default": BridgeSetting(_bits(2)),
    "int2-recent0": BridgeSetting(_bits(2, keep_recent_chunks=0)),
    "int2-recent-int4": BridgeSetting(_bits(2), EnvSettings(recent_tier="int4")),
    "int2-sink0": BridgeSetting(_bits(2, sink=False)),
    "int4-default": BridgeSetting(_bits(4)),
    "int4-recent0": BridgeSetting(_bits(4, keep_recent_chunks=0)),
    "fp8-default": BridgeSetting(_bits(4), EnvSettings(codec="fp8")),
    "fp8-recent0": BridgeSetting(_bits(4, keep_recent_chunks=0), EnvSettings(codec="fp8")),
    "nvfp4-default": BridgeSetting(_bits(4), EnvSettings(codec="nvfp4")),
    "nvfp4-recent0": BridgeSetting(_bits(4, keep_recent_chunks=0), EnvSettings(codec="nvfp4")),
}


def _attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA of ``q`` ``[B, n, H, D]`` over ``k``/``v`` ``[B, S, H, D]`` in float32."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2))
    return out.transpose(1, 2)


def request(m: ModelGeometry, setting: str, device: torch.device) -> dict:
    """One request through ``m.layers`` bridge blocks sharing a `PassMarker` (4 denoising
    passes, probes, and the context update, the commit, per chunk, as sglang's hooked stage
    marks them), beside sglang's dense cache for layer 0 on the same K/V and queries.

    Returns the peak bytes over the request (every block's storage and the largest one-call
    buffer, from the marker's ledger), the resident bytes at the end, sglang
    dense's allocation for all layers, and the largest relative L2 error of layer 0's
    attention output against dense attention on the same queries (512 of each chunk's, at its
    first denoising pass and at its context update).
    """
    quant = SETTINGS[setting].quant()
    marker = PassMarker()
    common = dict(batch_size=1, cache_size=m.cache, num_heads=m.heads, head_dim=m.head_dim,
                  dtype=torch.bfloat16, device=device, attention_window_size=m.cache)
    sink = m.sink_frames * m.tokens_per_frame
    common["sink_tokens"] = sink
    blocks = [SGLangQVGKVCache(**common, **_indices(device), global_sink_tokens=sink,
                               quant_args=quant, marker=marker) for _ in range(m.layers)]
    shape = (1, m.cache, m.heads, m.head_dim)
    dense = CausalSelfAttentionKVCache(
        k=torch.zeros(shape, dtype=torch.bfloat16, device=device),
        v=torch.zeros(shape, dtype=torch.bfloat16, device=device), **_indices(device),
        cache_size=m.cache, sink_tokens=sink, attention_window_size=m.cache,
        global_sink_tokens=sink)
    data = [StreamKV(m.heads, m.head_dim, seed=layer) for layer in range(m.layers)]
    qdata = StreamKV(m.heads, m.head_dim, seed=10_000)
    err = 0.0
    for c in range(m.chunks):
        kv = [(d.chunk(c, m.chunk, 0).to(device), d.chunk(c, m.chunk, 1).to(device)) for d in data]
        for step in range(5):  # 4 denoising passes, then the context update
            ctx = marker.committing(pin=c == m.pin_after) if step == 4 else marker.probing()
            with ctx:
                for layer, block in enumerate(blocks):
                    k, v = kv[layer]
                    view = block.update_and_get_attention_kv(
                        key=k, value=v, current_chunk_start=c * m.chunk)
                    if layer == 0 and step in (0, 4):
                        ref = dense.update_and_get_attention_kv(
                            key=k, value=v, current_chunk_start=c * m.chunk)
                        # queries: the first 512 of the chunk (the error of those rows;
                        # every query against the whole window would cost more than the stream)
                        q = qdata.chunk(c, min(m.chunk, 512), step).to(device)
                        a, b = _attn(q, view.k, view.v), _attn(q, ref.k, ref.v)
                        err = max(err, float((a - b).norm() / b.norm().clamp_min(1e-30)))
                    del view
        if m.pin_after is not None and c == m.pin_after:
            for block in blocks:
                block.pin_current_chunk(m.chunk)
            dense.pin_current_chunk(m.chunk)
    dense_bytes = m.layers * (dense.k.nbytes + dense.v.nbytes)
    held = sum(b.resident_nbytes() for b in blocks)
    return {
        "geometry": m.name, "setting": setting, "sglang": SETTINGS[setting].command(),
        "codec": quant.codec or "off", "recent_tier": quant.recent_tier,
        "layers": m.layers, "heads": m.heads,
        "chunk_tokens": m.chunk, "cache_tokens": m.cache, "chunks": m.chunks,
        "peak_bytes": marker.ledger.peak_nbytes, "resident_bytes": held, "dense_bytes": dense_bytes,
        "peak_ratio": marker.ledger.peak_nbytes / dense_bytes, "resident_ratio": held / dense_bytes,
        "attn_rel_err": err,
    }


def layers_table(rows: list[dict]) -> str:
    lines = [
        "All layers, the whole request (decode then attend; heads reduced, every byte scales "
        "with them; denoising passes are probes, the context update commits): peak = every block's "
        "storage + the largest one-call buffer; ratios to sglang's dense cache (all layers) in the same run",
        f"{'geometry':<13} {'setting':<17} {'peak/dense':>10} {'resident/dense':>14} "
        f"{'attn rel err':>12}  sglang flags (and causalkv's settings)",
    ]
    for r in rows:
        lines.append(f"{r['geometry']:<13} {r['setting']:<17} {r['peak_ratio']:>10.3f} "
                     f"{r['resident_ratio']:>14.3f} {r['attn_rel_err']:>12.2e}  {r['sglang']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--heads", type=int, default=Geometry.heads)
    ap.add_argument("--chunks", type=int, default=Geometry.chunks)
    ap.add_argument("--pin", type=int, default=Geometry.pin_after, help="pin after this chunk")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: on a shared CPU, idle cores are not "
                         "guaranteed, and oversubscribed threads distort every ratio; 0 = torch's default)")
    ap.add_argument("--repeat", type=int, default=3, help="timed streams per cache (the least counts)")
    ap.add_argument("--quick", action="store_true", help="a tiny geometry (what the test runs)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    ap.add_argument("--layers", action="store_true",
                    help="the whole-request view instead: every layer of each model "
                         f"({', '.join(MODELS)}) through the bridge per setting "
                         f"({', '.join(SETTINGS)}); --json prints a list of objects with "
                         "geometry, setting, peak_ratio, resident_ratio, attn_rel_err")
    ap.add_argument("--models", default=",".join(MODELS),
                    help="with --layers: which geometries (comma-separated)")
    ap.add_argument("--settings", default=",".join(SETTINGS),
                    help="with --layers: which settings (comma-separated; default: all)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.layers:
        names = [n.strip() for n in args.models.split(",") if n.strip()]
        unknown = sorted(set(names) - set(MODELS))
        if unknown:
            raise SystemExit(f"--models: unknown {unknown}; choose from {sorted(MODELS)}")
        chosen = [n.strip() for n in args.settings.split(",") if n.strip()]
        if bad := sorted(set(chosen) - set(SETTINGS)):
            raise SystemExit(f"--settings: unknown {bad}; choose from {list(SETTINGS)}")
        models = [QUICK_MODEL] if args.quick else [
            ModelGeometry(**{**MODELS[n].__dict__, "heads": args.heads}) for n in names]
        rows = []
        for m in models:
            for setting in chosen:
                rows.append(request(m, setting, torch.device(args.device)))
                print(f"... {m.name} {setting}", file=sys.stderr, flush=True)
        print(json.dumps(rows, indent=2) if args.json else layers_table(rows))
        return 0
    g = QUICK if args.quick else Geometry(heads=args.heads, chunks=args.chunks, pin_after=args.pin)
    result = run(g, torch.device(args.device), repeat=max(1, args.repeat))
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
