"""Fault rows of ``causalkv generate --nproc-per-node 2`` (2 gloo processes, tiny-wan): the
command ends with one stderr line and its documented exit status, no traceback, no file
written, and no process of the job (launcher or rank) alive when it returns.

Each row is one real job: ``python -m causalkv generate --nproc-per-node 2`` re-executes
itself under torchrun (`causalkv.runtime.processes.launch`). A small plugin, installed as an entry
point the ranks discover (``CKV_FAULT``), makes one rank pause after chunk 0 (the test then
signals the command), raise there, or kill itself. Every process of a job inherits a marker
variable, so the test finds any process of it that is still alive through ``/proc``. The jobs
start with the first test that needs them, two at a time (each is 4 Python processes).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fault_helpers import ROOT, TRACEBACK, files, processes_with

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; Linux signals")

FAULT_PLUGIN = '''
import os, pathlib, signal, sys, time
from causalkv.hooks import hookimpl

@hookimpl
def causalkv_chunk_done(chunk_index):
    mode, rank = os.environ.get("CKV_FAULT", ""), os.environ.get("RANK")
    if chunk_index != 0:
        return
    if mode == "pause" and rank == "0":
        pathlib.Path(os.environ["CKV_MARKER"]).touch()
        time.sleep(120)  # the signal ends this; if it never comes, fail fast
        sys.exit(99)
    if mode == "raise" and rank == "1":
        raise RuntimeError("rank 1 failed on purpose after chunk 0")
    if mode == "kill" and rank == "1":
        os.kill(os.getpid(), signal.SIGKILL)
'''

#: ``python -m causalkv`` with SIGINT's default handler: under ``make test &`` the test process
#: ignores SIGINT and so would the command (it keeps an inherited SIG_IGN, as it should)
AS_COMMAND = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'causalkv'; runpy.run_module('causalkv', run_name='__main__', alter_sys=True)"
)

#: name -> (CKV_FAULT, the signal the test sends once rank 0 pauses, extra flags)
JOBS: dict[str, tuple[str, int | None, list[str]]] = {
    "ok": ("", None, []),
    "sigint": ("pause", signal.SIGINT, ["--quiet"]),
    "sigterm": ("pause", signal.SIGTERM, ["--quiet"]),
    "rank-fault": ("raise", None, ["--quiet", "--strict-plugins"]),
    "rank-killed": ("kill", None, []),
}
JOB_TIMEOUT_S = 400
AT_ONCE = 2


def _site(root: Path) -> Path:
    site = root / "site"
    info = site / "ckv_fault_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (site / "ckv_fault_plugin.py").write_text(FAULT_PLUGIN)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ckv-fault-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[causalkv]\nckv_fault = ckv_fault_plugin\n")
    return site


class Jobs:
    """The jobs of `JOBS`, run `AT_ONCE` at a time in one fresh CAUSALKV_HOME."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        site = _site(tmp)
        self.home = tmp / "home"
        self.home.mkdir()
        self.results: dict[str, dict[str, Any]] = {}
        self.procs: list[subprocess.Popen[str]] = []
        self.gate = threading.Semaphore(AT_ONCE)
        # the suite's OMP_NUM_THREADS=1 (tests/conftest.py) left out: causalkv's launcher must set
        # it for the ranks, as for a user (inherited, the no-banner check would prove nothing)
        base = {k: v for k, v in os.environ.items()
                if not k.startswith(("CAUSALKV_", "CKV_")) and k != "OMP_NUM_THREADS"}
        base.update(CAUSALKV_HOME=str(self.home), CAUSALKV_PLUGINS="ckv_fault",
                    PYTHONPATH=os.pathsep.join([str(ROOT), str(site)]))
        self.threads = [
            threading.Thread(target=self._run, args=(name, base), daemon=True) for name in JOBS
        ]
        for t in self.threads:
            t.start()

    def _run(self, name: str, base: dict[str, str]) -> None:
        mode, sig, flags = JOBS[name]
        out = self.tmp / name
        out.mkdir()
        token = f"ckv-test-{uuid.uuid4().hex}"
        marker = self.tmp / f"{name}.paused"
        env = {**base, "CKV_FAULT": mode, "CKV_MARKER": str(marker), "CKV_TEST_TOKEN": token}
        # 3 frames per chunk: the pause jobs run 3 chunks, the rank fault 2 (rank 0 is then
        # already waiting in chunk 1's all-to-all when rank 1 fails), the others 1
        frames = {"pause": "9", "raise": "6"}.get(mode, "3")
        cmd = [sys.executable, "-c", AS_COMMAND, "generate", "--dtype", "float32", "--frames", frames,
               "--nproc-per-node", "2", "--output", str(out / "v.gif"), "--metrics", str(out / "m.json"), *flags]
        with self.gate:
            t0 = time.monotonic()
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            self.procs.append(proc)
            signalled = False
            if sig is not None:
                deadline = time.monotonic() + JOB_TIMEOUT_S
                while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.1)
                if marker.exists():
                    proc.send_signal(sig)
                    signalled = True
            try:
                _, err = proc.communicate(timeout=JOB_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            left_at_return = processes_with(token)
            time.sleep(2.0)  # nothing may be written after the command returned
            self.results[name] = {
                "rc": proc.returncode, "stderr": err, "out": out, "signalled": signalled,
                "left": left_at_return, "left_later": processes_with(token),
                "files": files(out), "seconds": time.monotonic() - t0,
            }

    def result(self, name: str) -> dict[str, Any]:
        self.threads[list(JOBS).index(name)].join(timeout=3 * JOB_TIMEOUT_S)
        r = self.results[name]
        print(f"{name}: exit {r['rc']} in {r['seconds']:.1f} s")
        return r

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # the job's own clean-up stops its ranks
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
        for t in self.threads:
            t.join(timeout=60)
        for r in self.results.values():
            for pid in r["left_later"]:
                with_suppress_kill(pid)
        shutil.rmtree(self.tmp, ignore_errors=True)


def with_suppress_kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Jobs]:
    j = Jobs(tmp_path_factory.mktemp("parallel-faults"))
    try:
        yield j
    finally:
        j.close()


def assert_ended_cleanly(r: dict[str, Any]) -> None:
    """No process of the job at return or after, and nothing written then."""
    assert r["left"] == [] and r["left_later"] == [], r
    assert files(r["out"]) == r["files"]


def test_a_job_that_succeeds_prints_nothing_on_stderr(jobs: Jobs) -> None:
    # no torchrun OMP_NUM_THREADS banner, no "unwaited collective" warning, no progress bar
    r = jobs.result("ok")
    assert r["rc"] == 0 and r["stderr"] == "", r["stderr"]
    assert r["files"] == {"v.gif", "m.json"}
    assert_ended_cleanly(r)


@pytest.mark.parametrize(("name", "code", "line"), [
    ("sigint", 130, "causalkv generate: interrupted after chunk 1 of 3; nothing written"),
    ("sigterm", 143, "causalkv generate: terminated after chunk 1 of 3; nothing written"),
])
def test_a_signal_to_the_command_stops_every_process(jobs: Jobs, name: str, code: int, line: str) -> None:
    r = jobs.result(name)
    assert r["signalled"], r["stderr"]
    assert r["rc"] == code, r["stderr"]
    assert r["stderr"].splitlines() == [line] and not TRACEBACK.search(r["stderr"])
    assert r["files"] == set()
    assert_ended_cleanly(r)


def test_a_fault_in_one_rank_is_one_line_naming_it(jobs: Jobs) -> None:
    """Rank 1 raises after chunk 0 while rank 0 waits in chunk 1's all-to-all: the launcher
    stops rank 0 as soon as rank 1 dies (no collective runs into its timeout) and the line
    names the plugin's error, nothing else."""
    r = jobs.result("rank-fault")
    assert r["rc"] == 2, r["stderr"]
    assert r["stderr"].splitlines() == [
        "causalkv generate: error: plugin 'ckv_fault' failed in causalkv_chunk_done at chunk 0 "
        "(RuntimeError: rank 1 failed on purpose after chunk 0); fix it, or turn it off with "
        "CAUSALKV_DISABLE_PLUGINS=ckv_fault"
    ]
    assert r["files"] == set()
    assert_ended_cleanly(r)


def test_a_rank_that_dies_without_a_word_is_named(jobs: Jobs) -> None:
    r = jobs.result("rank-killed")
    assert r["rc"] == 1, r["stderr"]
    assert r["stderr"].splitlines() == [
        "causalkv generate: error: rank 1 was killed by SIGKILL before it could report a fault; the job "
        "is stopped and nothing was written; rerun with --debug for the ranks' output"
    ]
    assert r["files"] == set()
    assert_ended_cleanly(r)


def test_which_rank_speaks_for_the_job() -> None:
    """`choose_report` and the signal line on made-up reports (the cases a real job hits only
    by timing: a signal while the job shuts down, a peer's failure reported first)."""
    from causalkv.runtime.processes.launch import RankReport, _signalled_line, choose_report

    prog = "causalkv generate"
    done0 = RankReport(0, "", 0, time_ns=5, done=3, total=3, written=("out/v.mp4", "out/m.json"))
    assert _signalled_line(prog, signal.SIGTERM, done0) == (
        "causalkv generate: terminated after the job finished (chunk 3 of 3); kept the complete files "
        "'out/v.mp4', 'out/m.json'"
    )
    peer = RankReport(0, f"{prog}: unexpected error (DistNetworkError: ...)", 1, time_ns=1, peer_failure=True)
    cause = RankReport(1, f"{prog}: error: the cause", 2, time_ns=2)
    stopped = RankReport(0, f"{prog}: terminated after chunk 1 of 3; nothing written", 143, time_ns=0)
    assert choose_report([peer, cause], signalled=None) is cause  # earlier, but a consequence
    assert choose_report([stopped, cause], signalled=None) is cause
    assert choose_report([peer], signalled=None, silent=[1]) is None  # the silent rank is the cause
    assert choose_report([peer], signalled=None) is peer
    assert choose_report([done0, RankReport(1, "", 0, 6)], signalled=None) is None
    interrupted = RankReport(0, f"{prog}: interrupted after chunk 1 of 3; nothing written", 130, 3, 1, 3)
    assert choose_report([cause, interrupted], signalled=signal.SIGINT) is interrupted
    assert _signalled_line(prog, signal.SIGINT, interrupted) == interrupted.line
    # rank 0 stopped by a peer's exit first: where it was, with the command's signal
    assert _signalled_line(prog, signal.SIGINT, RankReport(0, "x", 1, 0, 2, 3, peer_failure=True)) == (
        "causalkv generate: interrupted after chunk 2 of 3; nothing written"
    )
    assert _signalled_line(prog, signal.SIGTERM, None) == "causalkv generate: terminated before the first chunk; nothing written"


#: torchrun's failure report when rank 1 was killed and torchrun stopped rank 0, which exited
#: with causalkv's status for SIGTERM before it could report
TORCHRUN_TAIL = [
    "Failures:", "[1]:", "  rank      : 0 (local_rank: 0)", "  exitcode  : 143 (pid: 11)",
    "Root Cause (first observed failure):", "[0]:", "  rank      : 1 (local_rank: 1)",
    "  exitcode  : -9 (pid: 12)  (SIGKILL)",
]


def test_the_silent_rank_named_is_the_one_that_failed_on_its_own() -> None:
    """Of several ranks that ended without a report, the launcher names the first that torchrun
    did not stop (its exit code is not SIGINT's or SIGTERM's): before, it named the lowest,
    rank 0 "exited with status 143", for a job whose rank 1 was killed."""
    from causalkv.runtime.processes.launch import _died

    def who(line: str) -> str:
        return line.split(" before it could report")[0]

    assert who(_died([0, 1], TORCHRUN_TAIL, 1)) == "error: rank 1 was killed by SIGKILL"
    assert who(_died([], TORCHRUN_TAIL, 1)) == "error: rank 1 was killed by SIGKILL"
    assert who(_died([0], TORCHRUN_TAIL, 1)) == "error: rank 0 exited with status 143"  # the only one
    assert who(_died([0, 1], TORCHRUN_TAIL[:4], 1)) == "error: rank 0 exited with status 143"
    assert who(_died([1], [], 7)) == "error: rank 1 failed (torchrun exit status 7)"


def _as_rank_of_a_supervised_job(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    from causalkv.runtime.processes.launch import ENV_REPORTS

    for name, value in ((ENV_REPORTS, str(folder)), ("WORLD_SIZE", "2"), ("RANK", "0")):
        monkeypatch.setenv(name, value)


def test_a_sigterm_while_a_rank_reports_its_fault_leaves_the_report_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """torchrun stops a rank (SIGTERM) as soon as its peer dies, maybe while the rank reports
    the peer's failure: `run_guarded` reports outside its own SIGTERM block, inside `main`'s.
    The report is written whole and the fault's status returned. Before, `main`'s handler,
    armed again when the inner block ended, raised in the middle of the report: the rank
    printed "terminated while starting", wrote no report, and the launcher named it instead
    of the peer that died (seen under load in `make test`)."""
    from causalkv.cli import sigterm_raises
    from causalkv.cli.faults import Progress, run_guarded
    from causalkv.runtime.processes import launch

    _as_rank_of_a_supervised_job(monkeypatch, tmp_path)
    classify = launch.is_peer_failure

    def signalled_while_reporting(exc: BaseException) -> bool:
        os.kill(os.getpid(), signal.SIGTERM)  # torchrun stopping this rank
        time.sleep(0.2)  # a handler runs by now
        return classify(exc)

    def body() -> int:
        raise RuntimeError("[gloo] Connection reset by peer")

    monkeypatch.setattr(launch, "is_peer_failure", signalled_while_reporting)
    before = signal.getsignal(signal.SIGTERM)
    with sigterm_raises():  # `main`'s, around every command
        code = run_guarded("causalkv generate", body, progress=Progress())
    assert code == 1
    (report,) = launch._read_each(tmp_path, "end-rank*.json", lambda d: d)
    assert report["code"] == 1 and report["peer_failure"], report
    assert report["line"].startswith("causalkv generate: unexpected error (RuntimeError: [gloo] Connection")
    assert capsys.readouterr().err == ""  # the launcher prints the job's line
    assert signal.getsignal(signal.SIGTERM) == before  # the outer block restored what it found
    # a rank that finished: a SIGTERM after its report (the job shutting down) replaces nothing
    with sigterm_raises():
        assert run_guarded("causalkv generate", lambda: 0, progress=Progress()) == 0
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
    (report,) = launch._read_each(tmp_path, "end-rank*.json", lambda d: d)
    assert (report["code"], report["line"]) == (0, "")
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_rank_stopped_while_starting_reports_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A rank of a supervised job stopped while the commands import reports its line to the
    launcher instead of printing it (the launcher prints one line for the job)."""
    import causalkv.cli.commands
    from causalkv.cli import STARTING, Terminated, main
    from causalkv.runtime.processes.launch import _read_each

    def stopped(argv: object) -> int:
        raise Terminated()

    _as_rank_of_a_supervised_job(monkeypatch, tmp_path)
    monkeypatch.setattr(causalkv.cli.commands, "main", stopped)
    assert main(["generate"]) == 143
    (report,) = _read_each(tmp_path, "end-rank*.json", lambda d: d)
    assert (report["line"], report["code"]) == (STARTING.format(how="terminated"), 143)
    assert capsys.readouterr().err == ""


def test_print_stderr_is_one_line_and_nothing_when_stderr_is_gone(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`print_stderr` (the one way to stderr of the commands, the launcher, the plugin reports
    and `warn_line`): the line and a newline; a closed stream (``ValueError``) or one whose
    writes fail (``OSError``) prints nothing and raises nothing."""
    import io

    from causalkv.errors import print_stderr
    from causalkv.runtime.model_io.prompt_encoding import warn_line

    print_stderr("causalkv: a line")
    monkeypatch.delenv("RANK", raising=False)
    warn_line("a warning")
    assert capsys.readouterr() == ("", "causalkv: a line\ncausalkv: warning: a warning\n")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    warn_line("rank 1 is quiet")
    assert capsys.readouterr() == ("", "")
    monkeypatch.setenv("RANK", "x")  # not torchrun's: the warning still prints, and raises nothing
    warn_line("an unreadable rank")
    assert capsys.readouterr() == ("", "causalkv: warning: an unreadable rank\n")

    class Failing(io.StringIO):
        def write(self, s: str) -> int:
            raise OSError("stderr is gone")

    closed = io.StringIO()
    closed.close()
    from causalkv.plugin.manager import make_plugin_manager

    for gone in (closed, Failing()):
        monkeypatch.setattr(sys, "stderr", gone)
        print_stderr("lost")  # no exception
        # a plugin report (here: an env var naming no plugin) goes the same way: no exception
        assert make_plugin_manager(entry_points=(), env={"CAUSALKV_DISABLE_PLUGINS": "nosuch"})
