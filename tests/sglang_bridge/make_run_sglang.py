"""``make run-sglang``: causalkv inside ``sglang generate``, int2 against quant off.

Builds the tiny LongLive 2.0 checkpoint in sglang's format (``causalkv sglang-checkpoint
longlive2``), runs ``sglang generate`` twice on the same seed with two shots (a scene cut, so a
pinned shot sink): ``--kv-cache-quant int2`` and ``--kv-cache-quant off``, and prints the same
kind of table as ``make run``, read from the worker's log (the bridge's ``causalkv kv-cache
summary`` line and sglang's stage timing) and from the two saved videos.

Runs in the sglang test environment with ``PYTHONPATH=tests/sglang_bridge/site`` (the CPU
shims), which the Makefile sets.

    python tests/sglang_bridge/make_run_sglang.py [--out out/sglang]
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e import GEOMETRY, SHOTS, cli_args, psnr, read_video, run_cli, summaries  # noqa: E402

from causalkv.runtime.sglang_checkpoints import CHECKPOINTS, build_sglang_checkpoint  # noqa: E402

_STAGE_TIME = re.compile(r"\[LongLive2CausalDenoisingStage\] finished in ([0-9.]+) seconds")


def _row(cells: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in cells) for i in range(4)]
    return "\n".join(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
                  ).rstrip()
        for r in cells
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out/sglang", help="output folder (default out/sglang)")
    out = Path(parser.parse_args(argv).out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    ckpt = build_sglang_checkpoint("longlive2", out / "tiny-longlive2")
    chunks = (GEOMETRY["num_frames"] - 1) // 4 + 1
    chunks //= CHECKPOINTS["longlive2"].native["num_frames_per_block"]
    results = {}
    for mode in ("int2", "off"):
        command = cli_args(ckpt, out, mode, "--kv-cache-quant", mode)
        command[0] = "sglang"
        print("$", shlex.join(command), flush=True)
        rc, log, video = run_cli(ckpt, out, mode, "--kv-cache-quant", mode)
        (out / f"{mode}.log").write_text(log)
        found = summaries(log)
        times = _STAGE_TIME.findall(log)
        if rc != 0 or not video.exists() or len(found) != 1 or not times:
            print(log[-4000:], file=sys.stderr)
            print(f"sglang generate --kv-cache-quant {mode} failed (log: {out / f'{mode}.log'})",
                  file=sys.stderr)
            return 1
        results[mode] = (found[0], float(times[-1]) / chunks, read_video(video), video)
    (q, q_s, q_v, q_path), (r, r_s, r_v, r_path) = results["int2"], results["off"]
    q_b, r_b = int(q["resident_bytes"]), int(r["resident_bytes"])
    p = psnr(q_v, r_v)
    print(f"\nLongLive 2.0 in sglang generate ({GEOMETRY['height']}x{GEOMETRY['width']}, "
          f"{GEOMETRY['num_frames']} frames = {chunks} chunks, shots {SHOTS['shot_durations']}; "
          f"videos {r_path.name}, {q_path.name} in {out})")
    print(_row([
        ("", "off (bf16)", "int2", "ratio"),
        ("KV bytes (resident, end)", f"{r_b:,}", f"{q_b:,}", f"{r_b / max(1, q_b):.2f}x smaller"),
        ("frame PSNR vs off", "-", "identical" if p == float("inf") else f"{p:.1f} dB", ""),
        ("seconds per chunk (denoise)", f"{r_s:.2f}", f"{q_s:.2f}",
         f"{q_s / max(r_s, 1e-9):.2f}x time"),
        ("pinned shot sink (tokens)", r["pinned_tokens"], q["pinned_tokens"], ""),
        ("packed chunks per layer", r["packed_chunks"], q["packed_chunks"], ""),
    ]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
