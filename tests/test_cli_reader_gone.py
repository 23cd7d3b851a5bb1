"""A reader of stdout that goes away (``causalkv plugins | head -n 1``) ends every command
quietly: exit 0 and nothing on stderr (docs/usage.md, "Errors and exit codes";
`causalkv.cli`), whether the write that fails is a ``print`` inside the command
(unbuffered stdout, or output past the buffer) or the final flush of buffered output.

Every subcommand (and its ``--help``) runs in a child process whose stdout is a pipe that
the parent either closes at once (the reader gone before the first line: the failing write
is certain) or closes after reading one line, like ``head -n 1`` (the race a user meets:
repeated `TRIES` times). The children are forked from one driver that ran every case once
(the commands' imports, torch included, happen there), so a run costs milliseconds: each
child calls `causalkv.cli.main` as the console script does, then does what the interpreter
does at exit with stdout (flush it; a failure is "Exception ignored" and status 120) and
leaves with ``os._exit`` (tearing torch down would take seconds). The driver runs twice:
with ``PYTHONUNBUFFERED=1`` (every print writes) and without (the output waits in the
buffer until the end). Real ``python -m causalkv`` runs into a closed pipe check the console
entry point and the interpreter's own exit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: how often the ``head -n 1`` reader races each command (3 in 10 failed before the fix)
TRIES = 10

#: every subcommand, run for real at a size that prints several lines, and every ``--help``
RUNS: tuple[tuple[str, ...], ...] = (
    ("plugins",),
    ("plugins", "--json"),
    ("resolve", "tiny-wan"),
    ("resolve", "tiny-longlive2", "--multi-shot", "--json"),
    ("memory", "longlive2"),
    ("memory", "lingbot", "--json"),
    ("demo", "--chunks", "6"),
    ("sglang-checkpoint", "longlive2", "{ckpt}"),  # found complete: built once by the driver
    ("vllm-omni-checkpoint", "{vckpt}"),
    ("--version",),
    ("--help",),
)

DRIVER = r"""
import json, os, sys, tempfile, traceback
import torch
torch.set_num_threads(1)  # no thread pool in the driver: the forked children stay safe
from causalkv.cli import main
from causalkv.cli.commands import build_parser

cases, tries, out, ckpt, vckpt = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
subcommands = sorted(build_parser()._subparsers._group_actions[0].choices)
cases = cases + [[name, "--help"] for name in subcommands]
cases = [[a.format(ckpt=ckpt, vckpt=vckpt) for a in argv] for argv in cases]
# every case once, out of the measured runs: the commands' imports happen here (the children
# only run), and the two checkpoints are built (the children find them complete)
with open(os.devnull, "w") as quiet:
    saved = os.dup(1), os.dup(2)
    os.dup2(quiet.fileno(), 1), os.dup2(quiet.fileno(), 2)
    try:
        for argv in cases:
            try:
                main(argv)
            except SystemExit:
                pass
        sys.stdout.flush()
    finally:
        os.dup2(saved[0], 1), os.dup2(saved[1], 2)


def child(argv):
    # what the console script does, then what the interpreter does at exit (Py_FinalizeEx:
    # flush stdout; a failure prints "Exception ignored in: <stdout>" and makes the status
    # 120), without the seconds of tearing down torch's modules
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()
        code = 1
    status = code if isinstance(code, int) else (0 if code is None else 1)
    try:
        sys.stdout.flush()
    except BaseException:
        print("Exception ignored in:", repr(sys.stdout), file=sys.stderr)
        traceback.print_exc()
        status = 120
    sys.stderr.flush()
    os._exit(status)


results = []
for argv in cases:
    for reader in ["closed"] + ["head"] * tries:
        r, w = os.pipe()
        err = tempfile.TemporaryFile()
        pid = os.fork()
        if pid == 0:  # the command: stdout the pipe's writing end, stderr a file
            os.close(r)
            os.dup2(w, 1)
            os.close(w)
            os.dup2(err.fileno(), 2)
            child(argv)
        os.close(w)
        first = b""
        if reader == "head":  # like `head -n 1`: one line, then the reader goes away
            with os.fdopen(r, "rb", buffering=0) as pipe:
                while not first.endswith(b"\n"):
                    byte = pipe.read(1)
                    if not byte:
                        break
                    first += byte
        else:  # gone before the first line
            os.close(r)
        _, status = os.waitpid(pid, 0)
        err.seek(0)
        results.append({"argv": argv, "reader": reader, "exit": os.waitstatus_to_exitcode(status),
                        "stderr": err.read().decode(errors="replace"),
                        "first": first.decode(errors="replace")})
with open(out, "w") as f:
    json.dump({"subcommands": subcommands, "results": results}, f)
"""


@pytest.fixture(scope="module", params=["unbuffered", "buffered"])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp(request.param)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CAUSALKV_HOME": str(tmp / "home"),
           "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONUNBUFFERED", None)
    if request.param == "unbuffered":
        env["PYTHONUNBUFFERED"] = "1"
    out = tmp / "results.json"
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(RUNS), str(TRIES), str(out), str(tmp / "ckpt"),
         str(tmp / "vckpt")],
        env=env, cwd=tmp, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0 and out.exists(), (proc.stdout + proc.stderr)[-4000:]
    return json.loads(out.read_text())


def test_every_command_ends_quietly_when_its_reader_goes_away(runs: dict) -> None:
    results = runs["results"]
    # every subcommand the parser has is run, for real and for its --help
    ran = {r["argv"][0] for r in results}
    assert set(runs["subcommands"]) <= ran and {"plugins", "resolve", "memory", "generate"} <= ran
    assert len(results) == (len(RUNS) + len(runs["subcommands"])) * (1 + TRIES)
    failed = [(r["argv"], r["reader"], r["exit"], r["stderr"][-600:]) for r in results
              if r["exit"] != 0 or r["stderr"]]
    assert not failed, failed
    # the head reader got the command's first line: the commands did print into the pipe
    for r in results:
        if r["reader"] == "head":
            assert r["first"].endswith("\n"), (r["argv"], r["first"])
    heads = {tuple(r["argv"]): r["first"] for r in results if r["reader"] == "head"}
    assert heads["plugins",] == "Plugins:\n"
    assert heads["resolve", "tiny-wan"] == "model: tiny-wan\n"
    assert heads["--version",].startswith("causalkv ")


@pytest.mark.parametrize("argv", [("plugins",), ("generate", "--help")])
def test_the_console_entry_point_ends_quietly_into_a_closed_pipe(tmp_path: Path, argv: tuple[str, ...]) -> None:
    """``python -m causalkv`` itself, with its real interpreter exit, buffered (stdout a pipe,
    as for a user) and unbuffered, into a pipe whose reader is gone before the first line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CAUSALKV_HOME": str(tmp_path)}
    for unbuffered in ("", "1"):
        env["PYTHONUNBUFFERED"] = unbuffered
        r, w = os.pipe()
        os.close(r)  # the reader went away
        try:
            p = subprocess.run([sys.executable, "-m", "causalkv", *argv], stdout=w, stderr=subprocess.PIPE,
                               env=env, text=True, timeout=300)
        finally:
            os.close(w)
        assert (p.returncode, p.stderr) == (0, ""), (unbuffered, p.stderr[-2000:])


def test_a_broken_pipe_that_is_not_stdout_is_not_swallowed(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """The quiet exit is for stdout's reader only: a ``BrokenPipeError`` of another pipe (a
    child process's, a socket) while stdout is fine still ends the command as an error."""
    import causalkv.cli.commands as commands
    from causalkv.cli import main

    def run(argv: list[str] | None) -> int:
        raise BrokenPipeError(32, "Broken pipe", "another pipe")

    monkeypatch.setattr(commands, "main", run)
    with pytest.raises(BrokenPipeError, match="another pipe"):
        main(["plugins"])
