"""Running a sequence-parallel job as one command: one line per fault, no process left behind.

``causalkv generate --nproc-per-node N`` plans the request in the calling process, then
`run_supervised` runs the same command under ``python -m torch.distributed.run --standalone
--nproc-per-node N`` (`torchrun_command`) and supervises it:

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
  crashed; of several, the first not stopped by SIGINT or SIGTERM) is named with torchrun's
  exit code for it. The exit status is that line's.
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
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

from causalkv.env import text as env_text
from causalkv.errors import ConfigError, print_stderr

__all__ = [
    "ENV_REPORTS",
    "RankReport",
    "choose_report",
    "describe_exit",
    "env_world",
    "is_peer_failure",
    "launched_by_torchrun",
    "register_rank",
    "report_end",
    "reports_to_launcher",
    "run_supervised",
    "torchrun_command",
]

#: the folder the ranks of a supervised job write their reports into
ENV_REPORTS = "CAUSALKV_RANK_REPORTS"

#: seconds torchrun gets to stop its ranks after a signal (it waits 30 s itself, then kills)
SHUTDOWN_GRACE_S = 45.0

_PR_SET_PDEATHSIG = 1

T = TypeVar("T")


def _die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send ``sig`` to this process when its parent ends (``PR_SET_PDEATHSIG``);
    nothing elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    # lazy: Linux only
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def env_world() -> tuple[int, int, int, int]:
    """``(rank, world_size, local_rank, local_world_size)`` from torchrun's environment
    (``(0, 1, 0, 1)`` outside torchrun); `ConfigError` naming a variable that is not an int."""
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    return rank, world, _env_int("LOCAL_RANK", rank), _env_int("LOCAL_WORLD_SIZE", world)


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    try:
        return default if text is None else int(text)
    except ValueError:
        raise ConfigError(
            f"{name}={text!r} is not an int: torchrun sets it; unset it outside a torchrun job"
        ) from None


def launched_by_torchrun() -> bool:
    """True in a worker started by torchrun (or any launcher that sets ``WORLD_SIZE``)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def reports_to_launcher() -> bool:
    """True in a rank started by `run_supervised` (it reports its end instead of printing it)."""
    return env_text(ENV_REPORTS) is not None and launched_by_torchrun()


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
        _write_json(Path(env_text(ENV_REPORTS)) / f"pid-rank{env_world()[0]}.json", {"pid": os.getpid()})


def is_peer_failure(exc: BaseException) -> bool:
    """True when ``exc`` is a collective failing because another rank went away (torch's
    ``DistError`` family, or gloo/NCCL's connection errors): a consequence, not a cause."""
    try:
        # lazy: the supervising launcher classifies errors without loading torch
        from torch.distributed import DistError
    except ImportError:  # pragma: no cover - torch without distributed
        DistError = ()  # type: ignore[assignment]  # noqa: N806
    text = str(exc).lower()
    return isinstance(exc, DistError) or any(
        t in text for t in ("gloo", "nccl", "connection closed by peer", "connection reset by peer"))


@dataclasses.dataclass(frozen=True)
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
    def consequence(self) -> bool:
        """Ended because of another process: stopped by SIGINT/SIGTERM (torchrun stopping it, or
        the user), or a peer that went away."""
        return self.peer_failure or _stopped_by_signal(self.code)


def report_end(
    line: str, code: int, *, done: int = 0, total: int | None = None, peer_failure: bool = False,
    written: Sequence[str] = (),
) -> None:
    """In a supervised rank: record how it ended for the launcher (a `RankReport`): its ``line``
    (without a newline; empty for a success), exit ``code``, chunks ``done`` of ``total``,
    whether the fault is a `is_peer_failure`, the files it ``written``."""
    report = RankReport(env_world()[0], line, int(code), time.time_ns(), done, total, peer_failure, tuple(written))
    if (folder := env_text(ENV_REPORTS)) is not None:  # unset: no launcher to report to
        with contextlib.suppress(OSError):
            _write_json(Path(folder) / f"end-rank{env_world()[0]}.json", dataclasses.asdict(report))


def _read_each(folder: Path, pattern: str, make: Callable[[dict[str, Any]], T]) -> list[T]:
    """``make`` of each ``pattern`` file of ``folder`` (written by `_write_json`), in name
    order; a file that cannot be read or does not hold what ``make`` takes is skipped."""
    out = []
    for f in sorted(folder.glob(pattern)):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            out.append(make(json.loads(f.read_text())))
    return out


#: causalkv's own lines ("causalkv: warning: ...", "causalkv generate: ..."), not torchrun's
#: "causalkv FAILED" title
_OWN_LINE = re.compile(r"^causalkv(?: [a-z-]+)?: ")
_ROOT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_ROOT_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")


def describe_exit(code: int) -> str:
    """How a child process ended, from its exit code: ``"exited with status N"``, or for a
    negative code (a signal) ``"was killed by SIGKILL"``."""
    if code >= 0:
        return f"exited with status {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def _died(silent: Sequence[int], torchrun_tail: Sequence[str], rc: int) -> str:
    """The line for a job whose ``silent`` ranks ended without reporting (killed, crashed):
    the first of them that failed on its own by the exit code torchrun's failure report gives
    for it, not stopped by SIGINT or SIGTERM (torchrun stops the others when one dies; a rank
    stopped before it could report is silent too); else the first with a code, else the first."""
    codes: dict[int, int] = {}
    current = None
    for line in torchrun_tail:
        if m := _ROOT_RANK.match(line):
            current = int(m.group(1))
        elif (m := _ROOT_EXIT.match(line)) and current is not None:
            codes.setdefault(current, int(m.group(1)))
    known = [r for r in (silent or codes) if r in codes]
    own = [r for r in known if not _stopped_by_signal(codes[r])]
    rank = next(iter(own or known or silent), None)
    who = f"rank {rank}" if rank is not None else "a rank"
    how = describe_exit(codes[rank]) if rank in codes else f"failed (torchrun exit status {rc})"
    return (
        f"error: {who} {how} before it could report a fault; the job is stopped and nothing "
        "was written; rerun with --debug for the ranks' output"
    )


def _stopped_by_signal(code: int) -> bool:
    """An exit ``code`` of a process that SIGINT or SIGTERM ended: its own status for them
    (``128 + signal``: causalkv's commands exit so) or killed by one (a negative code)."""
    return code in (-signal.SIGINT, -signal.SIGTERM, 128 + signal.SIGINT, 128 + signal.SIGTERM)


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
    speaking = own or ([] if silent else faults)  # a consequence never speaks for a silent rank
    return speaking[0] if speaking else None


def _pid_is_ours(pid: int) -> bool:
    """True when ``pid`` runs and is a Python process of this job (guards against reuse)."""
    try:
        os.kill(pid, 0)
    except OSError:  # gone, or another user's (the pid was reused)
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc: trust the pid
    return b"causalkv" in cmdline


def _sigkill(pid: int) -> None:
    """SIGKILL the process group ``pid`` leads (torchrun's; each rank leads its own session)
    and ``pid`` itself; nothing for one that is gone."""
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(OSError):
            kill(pid, signal.SIGKILL)


def _kill_leftovers(folder: Path, wait_s: float = 10.0) -> None:
    """SIGKILL every rank of the job that still runs (its process group), and wait until none does."""
    pids = _read_each(folder, "pid-rank*.json", lambda d: int(d["pid"]))
    alive = [p for p in pids if _pid_is_ours(p)]
    for pid in alive:
        _sigkill(pid)
    deadline = time.monotonic() + wait_s
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _pid_is_ours(p)]
        time.sleep(0.05)


@contextlib.contextmanager
def _forwarding_signals(proc: subprocess.Popen[bytes]) -> Iterator[list[int]]:
    """SIGINT (unless inherited as ignored) and SIGTERM are sent on to ``proc`` (in the main
    thread: only it can handle signals); yields the list of signals received."""
    got: list[int] = []
    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}

    def handler(signum: int, frame: Any) -> None:
        got.append(signum)
        with contextlib.suppress(OSError):
            proc.send_signal(signum)

    for s, old in previous.items():
        if old != signal.SIG_IGN:
            signal.signal(s, handler)
    try:
        yield got
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def _pass_stderr(
    stream: IO[bytes], out: IO[str], *, debug: bool, seen: Iterable[str] = ()
) -> tuple[threading.Thread, collections.deque[str]]:
    """Read the job's stderr line by line in a thread: pass all of it with ``debug``, else each
    distinct ``causalkv`` line once. Returns the thread and the tail it keeps for `_died`."""
    shown, tail = set(seen), collections.deque(maxlen=400)

    def run() -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace")
            text = line.rstrip("\n")
            tail.append(text)
            if debug or (_OWN_LINE.match(line) and text not in shown):
                shown.add(text)
                with contextlib.suppress(OSError, ValueError, AttributeError):
                    out.write(line)
                    out.flush()
        with contextlib.suppress(OSError):
            stream.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, tail


def _rank_env(nproc: int, reports: Path, *, quiet: bool, debug: bool) -> dict[str, str]:
    env = {**os.environ, ENV_REPORTS: str(reports)}
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


def torchrun_command(nproc_per_node: int, argv: Sequence[str]) -> list[str]:
    """The single-node torchrun command running ``python -m causalkv <argv>`` on ``nproc_per_node`` ranks."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc_per_node}", "-m", "causalkv", *argv,
    ]


def run_supervised(
    nproc: int,
    argv: Sequence[str],
    *,
    prog: str = "causalkv generate",
    debug: bool = False,
    quiet: bool = False,
    seen: Iterable[str] = (),
) -> int:
    """Run ``causalkv <argv>`` on ``nproc`` local ranks under torchrun (`torchrun_command`),
    supervised as the module docstring says; the job's exit status.

    ``seen``: stderr lines this process already printed (plugin warnings the ranks repeat).
    """
    with tempfile.TemporaryDirectory(prefix="causalkv-ranks-", ignore_cleanup_errors=True) as tmp:
        reports = Path(tmp)
        proc = subprocess.Popen(
            torchrun_command(nproc, argv), env=_rank_env(nproc, reports, quiet=quiet, debug=debug),
            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        reader, tail = _pass_stderr(proc.stderr, sys.stderr, debug=debug, seen=seen)
        with _forwarding_signals(proc) as got:
            try:
                deadline: float | None = None
                while (rc := proc.poll()) is None:
                    time.sleep(0.05)
                    if got:  # torchrun gets SHUTDOWN_GRACE_S to stop its ranks, then it is killed
                        deadline = deadline or time.monotonic() + SHUTDOWN_GRACE_S
                        if time.monotonic() > deadline:
                            _sigkill(proc.pid)
            except BaseException:
                _sigkill(proc.pid)
                proc.wait()
                raise
            finally:
                _kill_leftovers(reports)
                found = _read_each(reports, "end-rank*.json",
                                   lambda d: RankReport(**{**d, "written": tuple(d["written"])}))
            reader.join(timeout=10)
    signalled = got[0] if got else None
    silent = sorted(set(range(nproc)) - {r.rank for r in found})
    chosen = choose_report(found, signalled=signalled, silent=silent)
    if signalled is not None:
        line, code = _signalled_line(prog, signalled, chosen), 128 + signalled
    elif rc == 0:
        return 0
    elif chosen is not None:
        line, code = chosen.line, chosen.code
    else:
        line, code = f"{prog}: {_died(silent, list(tail), rc)}", 1
    print_stderr(line)
    return code
