"""Issue 24's property: random combinations of the numeric flags of ``causalkv generate`` and
``causalkv demo`` either complete or are refused (exit 2, or 3) with one stderr line, within a
bounded time and memory.

One child process runs every example (torch is imported once): it lowers its address space
(``RLIMIT_AS``) to what it has mapped plus 1 GiB, so a request that allocates in proportion
to its sizes before checking them dies (MemoryError: exit 1, or a crash) instead of passing,
and the parent gives it a wall-clock limit (`CHILD_TIMEOUT_S`). ``generate`` runs as a dry
run: the real command line (parse, plan, every check before the load), then the load step
is replaced by a stop, which counts as "completes": what follows the load is the fault
tables' business (tests/test_cli_faults*.py). ``demo`` runs to the end. Hypothesis shrinks a
failing example inside the child, whose output the assertion shows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fault_helpers import ROOT

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS and /proc/self/statm are Linux's")

#: examples per property (a bounded number: the whole test takes seconds on 2 cores)
GENERATE_EXAMPLES = 100
DEMO_EXAMPLES = 30
#: the child's wall-clock limit (its imports, then 85 examples of ~50 ms on a busy machine)
CHILD_TIMEOUT_S = 300

CHILD = r'''
import contextlib, importlib, io, json, os, resource, sys, traceback
from hypothesis import HealthCheck, given, settings, strategies as st

import causalkv.cli.commands  # torch, diffusers' config readers: imported before the limit
from causalkv.cli import main

# the module (the package's attribute of that name is the function `generate`)
runtime_generate = importlib.import_module("causalkv.runtime.host.generate")

GENERATE_EXAMPLES, DEMO_EXAMPLES = int(sys.argv[1]), int(sys.argv[2])


class Loaded(BaseException):
    """The dry run's stop: the request passed every check and the load would begin."""


def stop(plan, *args, **kwargs):
    raise Loaded()


runtime_generate.load_for_plan = stop
page = os.sysconf("SC_PAGE_SIZE")
mapped = int(open("/proc/self/statm").read().split()[0]) * page
_soft, hard = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, (mapped + 2**30, hard))
outcomes = {}


def run(argv):
    """(outcome, stderr) of ``causalkv argv`` in this process."""
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            rc = main(argv)
        except Loaded:
            rc = "planned"
        except SystemExit as exc:  # argparse's usage errors
            rc = int(exc.code or 0)
    return rc, err.getvalue()


def check(argv):
    rc, err = run(argv)
    lines = err.strip("\n").splitlines()
    outcomes[str(rc)] = outcomes.get(str(rc), 0) + 1
    if rc in ("planned", 0):
        assert all(line.startswith("causalkv: warning: ") for line in lines), (argv, err)
    else:
        assert rc in (2, 3), (argv, rc, err)
        assert len(lines) == 1 and "Traceback" not in err, (argv, err)
        assert lines[0].startswith("causalkv"), (argv, err)


def big(lo, hi):
    return st.integers(lo, hi)


sizes = st.one_of(st.none(), big(-3, 48), big(10**3, 10**13))
flags = {
    "--frames": sizes,
    "--window-frames": sizes,
    "--sink-frames": st.one_of(st.none(), big(-2, 16), big(10**4, 10**12)),
    "--recent-window-frames": st.one_of(st.none(), big(-2, 30), big(10**4, 10**12)),
    "--seed": st.one_of(st.none(), big(-1, 2**66)),
    "--guidance-scale": st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)),
    "--kv-cache-quant-keep-recent": st.one_of(st.none(), big(-1, 2000)),
    "--kv-cache-quant-stages": st.one_of(st.none(), big(-1, 2000)),
    "--kv-cache-quant-centroids": st.one_of(st.none(), big(-1, 10**6)),
    "--kv-cache-quant-block-size": st.one_of(st.none(), st.sampled_from([-1, 0, 3, 7, 8, 12, 64, 128, 10**9])),
    "--multi-shot-rope-offset": st.one_of(st.none(), st.floats(-10, 1e12), st.just(float("nan"))),
}


@settings(max_examples=GENERATE_EXAMPLES, deadline=None, database=None, print_blob=True,
          suppress_health_check=list(HealthCheck))
@given(
    model=st.sampled_from(["tiny-wan", "tiny-longlive2", "tiny-lingbot"]),
    shots=st.integers(1, 6),
    quant=st.sampled_from([None, "int4", "int2"]),
    values=st.fixed_dictionaries({}, optional=flags),
    durations=st.one_of(st.none(), st.lists(big(-1, 10**9), min_size=1, max_size=6)),
)
def generate_completes_or_refuses(model, shots, quant, values, durations):
    argv = ["generate", "--quiet", "--dtype", "float32", "--no-video", "--model", model]
    for k in range(shots):
        argv.append(f"--prompt=shot {k}")
    if quant is not None:
        argv.append(f"--kv-cache-quant={quant}")
    for flag, value in values.items():
        if value is not None:
            argv.append(f"{flag}={value!r}" if isinstance(value, float) else f"{flag}={value}")
    if durations is not None and model == "tiny-longlive2":
        argv.append("--shot-durations=" + ",".join(map(str, durations)))
    check(argv)


@settings(max_examples=DEMO_EXAMPLES, deadline=None, database=None, print_blob=True,
          suppress_health_check=list(HealthCheck))
@given(
    chunks=st.one_of(big(-2, 160), big(10**6, 10**12)),
    tokens=st.one_of(big(-2, 64), big(10**7, 10**14)),
)
def demo_completes_or_refuses(chunks, tokens):
    check(["demo", f"--chunks={chunks}", f"--tokens-per-frame={tokens}"])


try:
    generate_completes_or_refuses()
    demo_completes_or_refuses()
except BaseException:
    traceback.print_exc()
    sys.exit(1)
print(json.dumps(outcomes))
'''


def test_random_numeric_flags_complete_or_are_refused_in_one_line(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CAUSALKV_HOME": str(home), "OMP_NUM_THREADS": "1"}
    for var in ("CAUSALKV_PLUGINS", "CAUSALKV_DISABLE_PLUGINS", "CAUSALKV_QVG_BACKEND"):
        env.pop(var, None)
    p = subprocess.run(
        [sys.executable, "-c", CHILD, str(GENERATE_EXAMPLES), str(DEMO_EXAMPLES)],
        env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, cwd=tmp_path,
    )
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-8000:]
    outcomes = json.loads(p.stdout.strip().splitlines()[-1])
    assert sum(outcomes.values()) >= GENERATE_EXAMPLES + DEMO_EXAMPLES
    assert outcomes.get("2", 0) > 0, outcomes  # the draws reach the refusals...
    assert outcomes.get("planned", 0) + outcomes.get("0", 0) > 0, outcomes  # ...and requests that run
    assert [p.name for p in home.rglob("*")] == [], "a dry run builds no preset"
