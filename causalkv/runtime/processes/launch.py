"""Running a sequence-parallel job as one command: one line per fault, no process left behind.

``causalkv generate --nproc-per-node N`` plans the request in the calling process, then
`run_supervised` runs the same command under ``python -m torch.distributed.run --standalone
--nproc-per-node N`` and supervises it:

- torchrun runs in its own session, so a Ctrl-C in the terminal reaches only this process,
  which forwards SIGINT or SIGTERM to torchrun; torchrun stops every rank with that signal.
  Each rank and torchrun get ``PR_SET_PDEATHSIG`` (Linux), so no process outlives the one
  that started it, even when this process is killed. After torchrun exits, a rank that is
  still running (it ignored the signals) is killed; the command returns only when none is
  left.
- Every rank reports how it ended (its one line, exit status, progress, files written) in a file of a
  private folder (``CAUSALKV_RANK_REPORTS``) instead of printing it. The command prints one
  line for the job: on a signal, rank 0's line ("interrupted after chunk i of N; nothing
  written"; after rank 0 finished: what it wrote); on a fault, the first rank's that failed on its own (not one stopped by a
  signal or by a peer that died after it); a rank that died without reporting (killed,
  crashed) is named with torchrun's exit code for it. The exit status is that line's.
- The ranks' stderr (torchrun's log, warnings, tracebacks, C++ stack traces) passes through
  this process: with ``--debug`` all of it, otherwise only causalkv's own lines
  (``causalkv: warning: ...``), each once. ``OMP_NUM_THREADS`` is set for the ranks (cores /
  N) unless it is set already, so torchrun has no banner to print; with ``--quiet`` the ranks
  also run with Python warnings and torch's C++ warnings off.

Under a user's own ``torchrun ... -m causalkv generate`` nothing of this applies: each rank
prints its own line, as one process does.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

__all__ = [
    "ENV_REPORTS",
    "RankReport",
    "choose_report",
    "is_peer_failure",
    "register_rank",
    "report_end",
    "reports_to_launcher",
    "run_supervised",
]

#: the folder the ranks of a supervised job write their reports into
ENV_REPORTS = "CAUSALKV_RANK_REPORTS"

#: seconds torchrun gets to stop its ranks after a signal (it waits 30 s itself, then kills)
SHUTDOWN_GRACE_S = 45.0

_PR_SET_PDEATHSIG = 1


def _die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send ``sig`` to this process when its parent ends (``PR_SET_PDEATHSIG``);
    nothing elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    # lazy: Linux only
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def reports_to_launcher() -> bool:
    """True in a rank started by `run_supervised` (it reports its end instead of printing it)."""
    return bool(os.environ.get(ENV_REPORTS)) and "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def register_rank() -> None:
    """In a supervised rank: record this process's pid and die with torchrun (SIGTERM)."""
    if not reports_to_launcher():
        return
    _die_with_parent(signal.SIGTERM)
    with contextlib.suppress(OSError):
        _write_json(Path(os.environ[ENV_REPORTS]) / f"pid-rank{_rank()}.json", {"pid": os.getpid()})


def is_peer_failure(exc: BaseException) -> bool:
    """True when ``exc`` is a collective failing because another rank went away (torch's
    ``DistError`` family, or gloo/NCCL's connection errors): a consequence, not a cause."""
    try:
        # lazy: the supervising launcher classifies errors without loading torch
        from torch.distributed import DistError
    except ImportError:  # pragma: no cover - torch without distributed
        DistError = ()  # type: ignore[assignment]  # noqa: N806
    if DistError and isinstance(exc, DistError):
        return True
    text = str(exc).lower()
    return any(t in text for t in ("gloo", "nccl", "connection closed by peer", "connection reset by peer"))


def report_end(
    line: str, code: int, *, done: int = 0, total: int | None = None, peer_failure: bool = False,
    written: Sequence[str] = (),
) -> None:
    """In a supervised rank: record how it ended for the launcher: its ``line`` (without a
    newline; empty for a success), exit ``code``, chunks ``done`` of ``total``, whether the
    fault is a `is_peer_failure`, the files it ``written``."""
    with contextlib.suppress(OSError, KeyError):
        _write_json(
            Path(os.environ[ENV_REPORTS]) / f"end-rank{_rank()}.json",
            {"rank": _rank(), "line": line, "code": int(code), "done": done, "total": total,
             "time_ns": time.time_ns(), "pid": os.getpid(), "peer_failure": peer_failure,
             "written": list(written)},
        )


@dataclass(frozen=True)
class RankReport:
    """How one rank ended: its line, exit status, chunks done, when (``time.time_ns``)."""

    rank: int
    line: str
    code: int
    time_ns: int
    done: int = 0
    total: int | None = None
    peer_failure: bool = False
    written: tuple[str, ...] = ()

    @property
    def by_signal(self) -> bool:
        """Stopped by SIGINT/SIGTERM (torchrun stopping it, or the user)."""
        return self.code in (128 + signal.SIGINT, 128 + signal.SIGTERM)

    @property
    def consequence(self) -> bool:
        """Ended because of another process: a signal, or a peer that went away."""
        return self.by_signal or self.peer_failure


def _read_reports(folder: Path) -> list[RankReport]:
    out = []
    for f in sorted(folder.glob("end-rank*.json")):
        try:
            d = json.loads(f.read_text())
            out.append(RankReport(int(d["rank"]), str(d["line"]), int(d["code"]), int(d["time_ns"]),
                                  int(d.get("done", 0)), d.get("total"), bool(d.get("peer_failure")),
                                  tuple(str(w) for w in d.get("written", ()))))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


#: causalkv's own lines ("causalkv: warning: ...", "causalkv generate: ..."), not torchrun's
#: "causalkv FAILED" title
_OWN_LINE = re.compile(r"^causalkv(?: [a-z-]+)?: ")
_ROOT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_ROOT_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")


def _died(rank: int | None, torchrun_tail: Sequence[str], rc: int) -> str:
    """The line for a job whose ``rank`` ended without reporting (killed, crashed), with the
    exit code torchrun's failure report gives for it."""
    code, current = None, None
    for line in torchrun_tail:
        if m := _ROOT_RANK.match(line):
            current = int(m.group(1))
        elif (m := _ROOT_EXIT.match(line)) and current is not None and (rank is None or current == rank):
            code, rank = int(m.group(1)), current
            break
    who = f"rank {rank}" if rank is not None else "a rank"
    if code is not None and code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    elif code is not None:
        how = f"exited with status {code}"
    else:
        how = f"failed (torchrun exit status {rc})"
    return (
        f"error: {who} {how} before it could report a fault; the job is stopped and nothing "
        "was written; rerun with --debug for the ranks' output"
    )


def choose_report(
    reports: Iterable[RankReport], *, signalled: int | None, silent: Sequence[int] = ()
) -> RankReport | None:
    """The report that speaks for the job: rank 0's when the command got a signal; else the
    earliest that is not another process's `RankReport.consequence`; else, unless a rank
    ended ``silent`` (without a report: it is the cause), the earliest (None: none to use)."""
    reports = sorted(reports, key=lambda r: r.time_ns)
    if signalled is not None:
        return next((r for r in reports if r.rank == 0), None)
    faults = [r for r in reports if r.code != 0]
    own = [r for r in faults if not r.consequence]
    if own:
        return own[0]
    if silent:
        return None
    return faults[0] if faults else None


def _pid_is_ours(pid: int) -> bool:
    """True when ``pid`` runs and is a Python process of this job (guards against reuse)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc: trust the pid
    return b"causalkv" in cmdline


def _kill_leftovers(folder: Path, wait_s: float = 10.0) -> None:
    """SIGKILL every rank of the job that still runs (its process group), and wait until none does."""
    pids = []
    for f in folder.glob("pid-rank*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            pids.append(int(json.loads(f.read_text())["pid"]))
    alive = [p for p in pids if _pid_is_ours(p)]
    for pid in alive:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)  # torchrun starts each rank in its own session
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _pid_is_ours(p)]
        time.sleep(0.05)


@contextlib.contextmanager
def _forwarding_signals(forward: Callable[[int], None]) -> Iterator[list[int]]:
    """SIGINT (unless inherited as ignored) and SIGTERM call ``forward(signum)``; yields the
    list of signals received."""
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum: int, frame: Any) -> None:
        got.append(signum)
        forward(signum)

    for s, old in previous.items():
        if old != signal.SIG_IGN:
            signal.signal(s, handler)
    try:
        yield got
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


class _StderrFilter:
    """Reads the job's stderr line by line: passes all of it with ``debug``, else each
    distinct ``causalkv`` line once; keeps the tail for `_died`."""

    def __init__(self, stream: IO[bytes], out: IO[str], *, debug: bool, seen: Iterable[str] = ()) -> None:
        self.stream, self.out, self.debug = stream, out, debug
        self.seen = set(seen)
        self.tail: collections.deque[str] = collections.deque(maxlen=400)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _emit(self, text: str) -> None:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            self.out.write(text)
            self.out.flush()

    def _run(self) -> None:
        for raw in iter(self.stream.readline, b""):
            line = raw.decode("utf-8", "replace")
            self.tail.append(line.rstrip("\n"))
            if self.debug:
                self._emit(line)
            elif _OWN_LINE.match(line) and line.rstrip("\n") not in self.seen:
                self.seen.add(line.rstrip("\n"))
                self._emit(line)
        with contextlib.suppress(OSError):
            self.stream.close()


def _rank_env(nproc: int, reports: Path, *, quiet: bool, debug: bool) -> dict[str, str]:
    env = dict(os.environ)
    env[ENV_REPORTS] = str(reports)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if quiet and not debug:
        env["PYTHONWARNINGS"] = "ignore"
        env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    return env


def _signalled_line(prog: str, signum: int, rank0: RankReport | None) -> str:
    """The job's line after the command got ``signum``: rank 0's own when the signal stopped
    it, else where rank 0 was (a rank that a peer's exit stopped first reports that instead)."""
    how = "interrupted" if signum == signal.SIGINT else "terminated"
    if rank0 is not None and rank0.code == 0:  # the signal came while the job shut down
        kept = ("kept the complete files " + ", ".join(repr(w) for w in rank0.written)
                if rank0.written else "it wrote nothing")
        return f"{prog}: {how} after the job finished (chunk {rank0.done} of {rank0.total}); {kept}"
    if rank0 is not None and rank0.code == 128 + signum:
        return rank0.line
    if rank0 is None or rank0.total is None:
        return f"{prog}: {how} before the first chunk; nothing written"
    return f"{prog}: {how} after chunk {rank0.done} of {rank0.total}; nothing written"


def run_supervised(
    command: Sequence[str],
    *,
    nproc: int,
    prog: str = "causalkv generate",
    debug: bool = False,
    quiet: bool = False,
    seen: Iterable[str] = (),
    stderr: IO[str] | None = None,
) -> int:
    """Run the torchrun ``command`` (`causalkv.runtime.processes.distributed.torchrun_command`) of
    ``nproc`` local ranks as described in the module docstring; the job's exit status.

    ``seen``: stderr lines this process already printed (plugin warnings the ranks repeat).
    """
    err = stderr if stderr is not None else sys.stderr
    reports = Path(tempfile.mkdtemp(prefix="causalkv-ranks-"))
    try:
        proc = subprocess.Popen(
            list(command), env=_rank_env(nproc, reports, quiet=quiet, debug=debug),
            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    except BaseException:
        shutil.rmtree(reports, ignore_errors=True)
        raise
    assert proc.stderr is not None
    reader = _StderrFilter(proc.stderr, err, debug=debug, seen=seen)

    def forward(signum: int) -> None:
        with contextlib.suppress(OSError):
            proc.send_signal(signum)

    try:
        with _forwarding_signals(forward) as got:
            deadline: float | None = None
            while True:
                try:
                    rc = proc.wait(timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if got and deadline is None:
                    deadline = time.monotonic() + SHUTDOWN_GRACE_S
                if deadline is not None and time.monotonic() > deadline:
                    with contextlib.suppress(OSError):
                        os.killpg(proc.pid, signal.SIGKILL)
            _kill_leftovers(reports)
            reader.thread.join(timeout=10)
            signalled = got[0] if got else None
    except BaseException:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        _kill_leftovers(reports)
        shutil.rmtree(reports, ignore_errors=True)
        raise
    found = _read_reports(reports)
    silent = sorted(set(range(nproc)) - {r.rank for r in found})
    chosen = choose_report(found, signalled=signalled, silent=silent)
    shutil.rmtree(reports, ignore_errors=True)
    if signalled is not None:
        line, code = _signalled_line(prog, signalled, chosen), 128 + signalled
    elif rc == 0:
        return 0
    elif chosen is not None:
        line, code = chosen.line, chosen.code
    else:
        line, code = f"{prog}: {_died(silent[0] if silent else None, list(reader.tail), rc)}", 1
    with contextlib.suppress(OSError, ValueError, AttributeError):
        print(line, file=err, flush=True)
    return code
