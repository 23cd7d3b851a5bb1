"""Figures of the benchmarks: PNGs for the docs, drawn with matplotlib (extra ``bench``).

    .venv/bin/python benchmarks/report.py                          # run what is needed, write docs/figures
    .venv/bin/python benchmarks/report.py --codec-json c.json --generate-json g.json   # reuse JSON
    .venv/bin/python benchmarks/report.py --quick                  # smaller runs (smoke)

Figures (in ``--out``, default ``docs/figures/``):

- ``codec_error_vs_bits.png``: relative error vs bits per element of every method and peer of
  ``benchmarks/codec.py --json`` (its ``quality`` rows), 2 and 4 bits, K and V, structured and
  Gaussian data. Peers are placed at their counted bits (16-bit scale and zero per group).
- ``resident_kv_per_chunk.png``: resident KV bytes after each chunk of a long LongLive-2.0-like
  multi-shot stream (110 tokens per frame, 8-frame chunks, 8-frame global and shot sinks,
  32-frame window, 2 heads x 128, a scene cut pinned every 4 chunks), for the dense bf16 cache
  and the packed cache at int4 and int2, driven directly with `StreamKV` data of
  ``benchmarks/cache.py``; scene cuts are marked.
- ``attention_temp_memory.png``: peak temporary bytes of attention for one chunk of queries over
  an int2 packed cache, segment streaming (`AttendStats.peak_transient_nbytes`) vs the
  materialized window's K+V, against the window length.
- ``e2e_time_ratio.png``: per stage, seconds per chunk and peak KV bytes of int4 and int2 as
  ratios to off, from ``benchmarks/generate.py --json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from cache import StreamConfig, StreamKV  # noqa: E402

from causalkv.caches import DenseCausalKVCache  # noqa: E402
from causalkv.caches.attention import AttendStats, attend  # noqa: E402
from causalkv.caches.qvg.options import QVGKVQuantArgs  # noqa: E402
from causalkv.caches.qvg.packed import QVGPackedCausalKVCache  # noqa: E402

COLORS = {"off": "#444444", "int4": "#1f77b4", "int2": "#d62728"}


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _run_json(script: str, *args: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, str(HERE / script), *args], capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{script} {' '.join(args)} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


# ---------------------------------------------------------------------------------------------
# (a) codec: error vs bits
# ---------------------------------------------------------------------------------------------
def plot_codec(codec: dict[str, Any], out: Path) -> Path:
    """Relative error vs bits per element, one panel per (data, tensor)."""
    plt = _plt()
    rows = codec["quality"]
    datas = [d for d in ("structured", "gaussian") if any(r["data"] == d for r in rows)]
    fig, axes = plt.subplots(len(datas), 2, figsize=(14, 4.6 * len(datas)), squeeze=False)
    markers = {"baseline": "s", "peer": "^", "prq": "o", "fp8": "D", "nvfp4": "P"}
    methods = sorted({r["method"] for r in rows})
    cmap = plt.get_cmap("tab20")
    peer_colors = iter(("#000000", "#e6007e", "#00a0a0", "#7a4b00"))
    fams = {r["method"]: r.get("family", "prq") for r in rows}
    color = {m: next(peer_colors, "#000000") if fams[m] == "peer" else cmap(i % 20)
             for i, m in enumerate(methods)}
    for i, data in enumerate(datas):
        for j, tensor in enumerate(("K", "V")):
            ax = axes[i][j]
            for m in methods:
                pts = sorted((r["bits_per_element"], r["rel_err"], r.get("family", "prq"))
                             for r in rows if r["data"] == data and r["tensor"] == tensor
                             and r["method"] == m)
                if not pts:
                    continue
                fam = pts[0][2]
                peer = fam == "peer"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers.get(fam, "o"),
                        ls="-" if fam == "prq" else "--", lw=1.6 if peer else 0.8, ms=9 if peer else 6,
                        color=color[m], label=f"{m} (peer)" if peer else m, zorder=3 if peer else 2)
            ax.set_yscale("log")
            ax.set_xlabel("bits per element (peers: 16-bit scale + zero per group)")
            ax.set_ylabel("relative error ||x^ - x|| / ||x||")
            ax.set_title(f"{data} data, {tensor}")
            ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(0.83, 0.5), fontsize=8,
               title="o PRQ, ^ peer, s baseline")
    fig.suptitle("Codec: relative error vs bits per element, 2 and 4 bits")
    fig.tight_layout(rect=(0, 0, 0.82, 0.97))
    path = out / "codec_error_vs_bits.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# (b) resident KV bytes over a long multi-shot stream
# ---------------------------------------------------------------------------------------------
LONG = StreamConfig("longlive2-long", 110, 8, 8, 8, 32, heads=2, scene_cut_every=4)


def resident_series(chunks: int, cfg: StreamConfig = LONG) -> dict[str, Any]:
    """Resident bytes after each chunk for off / int4 / int2 (same data, same pins)."""
    spec = cfg.spec()
    caches = {
        "off": DenseCausalKVCache(spec),
        "int4": QVGPackedCausalKVCache(spec, QVGKVQuantArgs(codec="int4")),
        "int2": QVGPackedCausalKVCache(spec, QVGKVQuantArgs(codec="int2")),
    }
    data = StreamKV(cfg.heads, cfg.head_dim)
    n = cfg.chunk
    series: dict[str, list[int]] = {m: [] for m in caches}
    cuts = []
    for i in range(chunks):
        k, v = data.chunk(i, n, 0), data.chunk(i, n, 1)
        cut = i > 0 and i % cfg.scene_cut_every == 0
        if cut:
            cuts.append(i)
        for mode, cache in caches.items():
            cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=i * n)
            if cut:
                cache.pin_current_chunk(n)
            series[mode].append(cache.resident_nbytes())
    return {"tokens_per_chunk": n, "chunks": chunks, "scene_cuts": cuts, "resident_bytes": series}


def plot_resident(res: dict[str, Any], out: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(11, 4.6))
    x = list(range(res["chunks"]))
    for i, c in enumerate(res["scene_cuts"]):
        ax.axvline(c, color="#999999", lw=0.6, ls=":", label="scene cut (shot sink pinned)" if i == 0 else None)
    for mode, ys in res["resident_bytes"].items():
        label = {"off": "off (bf16 dense)", "int4": "int4 packed", "int2": "int2 packed"}[mode]
        ax.plot(x, [y / 2**20 for y in ys], color=COLORS[mode], lw=1.8, label=label)
    ax.set_ylim(bottom=0)
    ax.set_xlabel(f"chunk ({res['tokens_per_chunk']:,} tokens each)")
    ax.set_ylabel("resident KV (MiB, one layer)")
    ax.set_title("Resident KV bytes over a LongLive-2.0-like multi-shot stream: flat while pins come and go")
    ax.legend(loc="center right", fontsize=9)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path = out / "resident_kv_per_chunk.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# (c) attention temporary memory vs window
# ---------------------------------------------------------------------------------------------
def attention_memory(window_chunks: list[int], tokens_per_frame: int = 110) -> dict[str, Any]:
    """Per window length: streaming peak and materialized K+V bytes (int2 packed cache)."""
    rows = []
    for w in window_chunks:
        cfg = StreamConfig(f"w{w}", tokens_per_frame, 8, 8, 8, 8 * w, heads=2)
        cache = QVGPackedCausalKVCache(cfg.spec(), QVGKVQuantArgs(codec="int2"))
        data = StreamKV(cfg.heads, cfg.head_dim)
        n = cfg.chunk
        for i in range(w + 1):
            view = cache.update_and_get_attention_kv(
                key=data.chunk(i, n, 0), value=data.chunk(i, n, 1), current_chunk_start=i * n)
        stats = AttendStats()
        attend(data.chunk(w + 1, n, 2), view, stats=stats)
        materialized = view.k.nbytes + view.v.nbytes
        rows.append({"window_tokens": view.num_visible, "streaming_peak_bytes": stats.peak_transient_nbytes,
                     "materialized_bytes": materialized, "chunk_tokens": n})
    return {"rows": rows}


def plot_attention(res: dict[str, Any], out: Path) -> Path:
    plt = _plt()
    rows = res["rows"]
    x = [r["window_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.6))
    ax.plot(x, [r["materialized_bytes"] / 2**20 for r in rows], "o-", color="#444444",
            label="materialized window (dequantized K+V)")
    ax.plot(x, [r["streaming_peak_bytes"] / 2**20 for r in rows], "o-", color="#d62728",
            label="segment streaming (AttendStats peak)")
    ax.set_xlabel(f"visible window (tokens; queries: one chunk of {rows[0]['chunk_tokens']:,})")
    ax.set_ylabel("peak temporary bytes (MiB, one layer)")
    ax.set_title("Attention temporary memory over an int2 packed cache")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=9)
    fig.tight_layout()
    path = out / "attention_temp_memory.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# (d) end to end
# ---------------------------------------------------------------------------------------------
def plot_e2e(gen: dict[str, Any], out: Path) -> Path:
    plt = _plt()
    stages = list(gen)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    width = 0.38
    for ax, key, title in ((axes[0], "time_ratio", "seconds per chunk / off"),
                           (axes[1], "kv_ratio", "peak KV bytes / off")):
        for k, mode in enumerate(("int4", "int2")):
            xs = [i + (k - 0.5) * width for i in range(len(stages))]
            ys = [gen[s][mode][key] for s in stages]
            bars = ax.bar(xs, ys, width, color=COLORS[mode], label=mode)
            ax.bar_label(bars, fmt="%.2f", fontsize=8)
        ax.axhline(1.0, color="#444444", lw=1, label="off")
        if key == "time_ratio":
            ax.axhline(1.5, color="#999999", lw=1, ls="--", label="target int2 <= 1.5x")
        labels = [f"{s}\n{gen[s]['geometry']['tokens_per_chunk']:,} tok/chunk" for s in stages]
        ax.set_xticks(range(len(stages)), labels, fontsize=8)
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("End to end (benchmarks/generate.py): int4 and int2 relative to the bf16 cache, same run")
    fig.tight_layout()
    path = out / "e2e_time_ratio.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(HERE.parent / "docs" / "figures"), help="folder of the PNGs")
    p.add_argument("--codec-json", default=None, help="read benchmarks/codec.py --json output")
    p.add_argument("--generate-json", default=None, help="read benchmarks/generate.py --json output")
    p.add_argument("--chunks", type=int, default=100, help="chunks of the long stream (default 100)")
    p.add_argument("--quick", action="store_true", help="smaller runs (smoke)")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    quick = ["--quick"] if args.quick else []
    codec = (json.loads(Path(args.codec_json).read_text()) if args.codec_json
             else _run_json("codec.py", "--json", "--only", "quality", *quick))
    gen = (json.loads(Path(args.generate_json).read_text()) if args.generate_json
           else _run_json("generate.py", "--json", *quick))
    paths = [
        plot_codec(codec, out),
        plot_resident(resident_series(20 if args.quick else args.chunks), out),
        plot_attention(attention_memory([2, 4] if args.quick else [2, 4, 8, 16, 32]), out),
        plot_e2e(gen, out),
    ]
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
