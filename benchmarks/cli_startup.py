"""How long the command line takes to answer ``--version`` and each ``--help``: a fresh
interpreter per run (``python -m causalkv ARGS``), the least and the median wall seconds of
``--repeats`` runs per command, run in turns (each round runs every command once), and
whether the command imported torch, diffusers or transformers (it should not: they load
when a command needs them). Target: under 0.5 s each on a quiet machine. The CPU seconds
(user + system of the child, least of the runs) are printed too: on a machine other work
shares, the wall time measures the queue, the CPU time what the command itself costs.

    .venv/bin/python benchmarks/cli_startup.py              # table
    .venv/bin/python benchmarks/cli_startup.py --repeats 9  # more runs per command
    .venv/bin/python benchmarks/cli_startup.py --json
    .venv/bin/python benchmarks/cli_startup.py --quick      # one run per command (smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: every entry of the command line a user asks for help first
COMMANDS: tuple[tuple[str, ...], ...] = (
    ("--version",),
    ("--help",),
    ("generate", "--help"),
    ("plugins", "--help"),
    ("resolve", "--help"),
    ("demo", "--help"),
    ("memory", "--help"),
    ("sglang-checkpoint", "--help"),
    ("vllm-omni-checkpoint", "--help"),
)

HEAVY = ("torch", "diffusers", "transformers")

#: runs the console script's entry point, then reports which heavy modules it imported
_PROBE = (
    "import sys\n"
    "from causalkv.cli import main\n"
    "try:\n"
    "    code = main(sys.argv[1:])\n"
    "except SystemExit as e:\n"
    "    code = e.code\n"
    f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
    "sys.stderr.write('HEAVY ' + ','.join(heavy) + '\\n')\n"
    "sys.exit(code or 0)\n"
)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(args: tuple[str, ...]) -> tuple[float, float, list[str]]:
    """Wall and CPU seconds of one fresh interpreter answering ``causalkv ARGS``, and the
    heavy modules it imported."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cpu0, t0 = _children_cpu(), time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True,
                          env=env, timeout=300)
    seconds, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    if proc.returncode != 0:
        raise SystemExit(f"causalkv {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")
    line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("HEAVY "))
    return seconds, cpu, [m for m in line[len("HEAVY "):].split(",") if m]


def measure(repeats: int) -> list[dict[str, object]]:
    times: dict[tuple[str, ...], list[float]] = {c: [] for c in COMMANDS}
    cpus: dict[tuple[str, ...], list[float]] = {c: [] for c in COMMANDS}
    heavy: dict[tuple[str, ...], list[str]] = {}
    for _ in range(repeats):
        for c in COMMANDS:  # in turns: a slow moment of the machine hits every command alike
            seconds, cpu, imported = run_once(c)
            times[c].append(seconds)
            cpus[c].append(cpu)
            heavy[c] = imported
    return [
        {"command": "causalkv " + " ".join(c), "least_s": min(t), "median_s": statistics.median(t),
         "cpu_least_s": min(cpus[c]), "repeats": len(t), "heavy_imports": heavy[c]}
        for c, t in times.items()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs per command (default 5)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--quick", action="store_true",
                        help="one run per command (a smoke run: the table, not a timing)")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = 1
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    rows = measure(args.repeats)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max(len(str(r["command"])) for r in rows)
    print(f"{'command':<{width}}  least_s  median_s  cpu_s  imports torch/diffusers/transformers")
    for r in rows:
        print(f"{r['command']:<{width}}  {r['least_s']:7.3f}  {r['median_s']:8.3f}  "
              f"{r['cpu_least_s']:5.2f}  {', '.join(r['heavy_imports']) or 'none'}")  # type: ignore[arg-type]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{args.repeats} runs per command, a fresh interpreter each ({sys.executable}); "
          f"load average {load:.1f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
