"""``make run-sglang``: causalkv inside ``sglang generate``, int2 against quant off.

Builds the tiny LongLive 2.0 checkpoint in sglang's format (``causalkv sglang-checkpoint
longlive2``: random weights), runs ``sglang generate`` twice on the same seed with two shots
(a scene cut, so a pinned shot sink): ``--kv-cache-quant off`` (sglang's own dense cache) and
``--kv-cache-quant int2`` (causalkv's packed cache, through the bridge's entry point), and
prints one table, read from each worker's log (the bridge's ``causalkv kv-cache summary``
line) and from the two saved videos: the cache class each setting ran on, its KV bytes, the
frame PSNR of int2 against off, the pinned shot sink and the packed chunks.

It prints no time: two ``sglang generate`` processes, one request each, on a CPU that other
work shares, time nothing that a ratio could be drawn from (measured: the same request took
0.3 s to 2.2 s to denoise in one warm process). ``benchmarks/sglang_bridge.py`` times
sglang's caches and causalkv's per attention call, warm, the least of ``--repeat`` streams
in one process.

Runs in the sglang environment with ``PYTHONPATH=demo/sglang/cpu_stand_ins`` (the CPU
stand-ins for sglang's GPU kernels, docs/sglang.md), which the Makefile sets.

    python demo/sglang/run_int2_vs_off.py [--out out/sglang]
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from longlive2_request import GEOMETRY, SHOTS, cli_args, psnr, read_video, run_cli, summaries

from causalkv.runtime.host.compare_step import bytes_ratio
from causalkv.runtime.tools.checkpoints import CHECKPOINTS, build_checkpoint

#: the two settings, as ``sglang generate --kv-cache-quant`` values
SETTINGS = ("off", "int2")


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
                  ).rstrip()
        for r in rows
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out/sglang", help="output folder (default out/sglang)")
    out = Path(parser.parse_args(argv).out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    ckpt = build_checkpoint("longlive2", out / "tiny-longlive2")
    chunks = (GEOMETRY["num_frames"] - 1) // 4 + 1
    chunks //= CHECKPOINTS["longlive2"].native["num_frames_per_block"]
    runs = {}
    for mode in SETTINGS:
        command = cli_args(ckpt, out, mode, "--kv-cache-quant", mode)
        command[0] = "sglang"
        print("$", shlex.join(command), flush=True)
        rc, log, video = run_cli(ckpt, out, mode, "--kv-cache-quant", mode)
        (out / f"{mode}.log").write_text(log)
        found = summaries(log)
        if rc != 0 or not video.exists() or len(found) != 1:
            print(log[-4000:], file=sys.stderr)
            print(f"sglang generate --kv-cache-quant {mode} failed (log: {out / f'{mode}.log'})",
                  file=sys.stderr)
            return 1
        runs[mode] = (found[0], read_video(video), video)
    (r, r_v, r_path), (q, q_v, q_path) = runs["off"], runs["int2"]
    r_b, q_b = int(r["resident_bytes"]), int(q["resident_bytes"])
    r_p, q_p, dense = int(r["peak_bytes"]), int(q["peak_bytes"]), int(q["dense_bytes"])
    p = psnr(q_v, r_v)
    print(f"\ncausalkv in sglang generate: LongLive 2.0, tiny checkpoint with RANDOM weights "
          f"({GEOMETRY['height']}x{GEOMETRY['width']}, {GEOMETRY['num_frames']} frames = "
          f"{chunks} chunks, shots {SHOTS['shot_durations']}; videos {r_path.name}, "
          f"{q_path.name} in {out})")
    print(_table([
        ("", "off", "int2", "ratio"),
        ("KV cache class", f"sglang {r['cache']}", f"causalkv {q['cache']}", ""),
        ("KV bytes (peak over the request: all layers,", f"{r_p:,}", f"{q_p:,}",
         bytes_ratio(r_p, q_p)),
        (" the chunk scratch, one call's buffer)", "", "", ""),
        ("KV bytes (resident, end)", f"{r_b:,}", f"{q_b:,}", bytes_ratio(r_b, q_b)),
        ("sglang's dense cache allocates", f"{dense:,}", f"{dense:,}", ""),
        ("frame PSNR vs off (*)", "-", "identical" if p == float("inf") else f"{p:.1f} dB", ""),
        ("pinned shot sink (tokens)", r["pinned_tokens"], q["pinned_tokens"], ""),
        ("packed chunks per layer", r["packed_chunks"], q["packed_chunks"], ""),
    ]))
    print("The tiny checkpoint has 2 layers, so one layer's gathered window (in the int2 peak) is "
          "half of what all its layers hold; at LongLive 2.0's 30 layers it is 1/30 "
          "(benchmarks/sglang_bridge.py --layers, docs/benchmarks.md).")
    print("(*) the weights are random: the PSNR says how far int2's frames drift from off's on "
          "the same seed, not how good either video is.\nNo time row: one request per process "
          "on a shared CPU times nothing comparable; benchmarks/sglang_bridge.py times both "
          "caches warm, the least of --repeat streams in one process.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
