"""Triton kernel tests under ``TRITON_INTERPRET=1``: the interpreter must be set before triton
is imported, so a test file's kernel cases run in a child pytest process of their own."""

from __future__ import annotations

import os
import subprocess
import sys

#: True in the interpreted child process (where a file's kernel cases are defined)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def run_interpreted(path: str) -> None:
    """Run the test file ``path`` in a child pytest with ``TRITON_INTERPRET=1``; every case
    must pass and none may be skipped."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path],
        env=env, capture_output=True, text=True, timeout=900,
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in tail and "skipped" not in tail, tail
