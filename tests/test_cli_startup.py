"""``causalkv --version``, ``--help`` and every subcommand's ``--help`` answer without importing
torch, diffusers or transformers (they load when a command needs them). The time itself is
``benchmarks/cli_startup.py``'s, not a test's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# one interpreter answers every command in turn, then reports what it imported
_PROBE = """
import contextlib, io, sys
from causalkv.cli import main
from causalkv.cli.commands import build_parser

subcommands = list(build_parser()._subparsers._group_actions[0].choices)
for argv in [["--version"], ["--help"], *[[c, "--help"] for c in subcommands]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(argv)
        except SystemExit as exc:
            assert exc.code in (0, None), (argv, exc.code)
    assert out.getvalue().strip(), argv
print(",".join(subcommands))
print(",".join(m for m in ("torch", "diffusers", "transformers") if m in sys.modules))
"""


def test_help_and_version_import_no_torch() -> None:
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    subcommands, heavy = proc.stdout.splitlines()[-2:]
    assert {"generate", "plugins", "resolve", "demo", "memory", "sglang-checkpoint"} <= set(subcommands.split(","))
    assert heavy == "", f"--help imported {heavy}"
