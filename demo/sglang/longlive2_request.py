"""The request of the CPU demo (``make run-sglang``), shared with causalkv's sglang end-to-end
tests (``tests/sglang_bridge/e2e.py`` imports it): a two-shot LongLive 2.0 request on the tiny
checkpoint, and how to read what sglang's worker did with it.

Runs in the sglang environment; imports nothing from causalkv's tests.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np

#: the environment's ``sglang`` command (next to this Python)
SGLANG = str(Path(sys.executable).with_name("sglang"))

#: a two-shot LongLive 2.0 request: 29 frames = 8 latent frames = 4 chunks of 2, the second
#: shot (chunks 2-3) opens with a scene cut that sglang pins as the shot sink
SHOTS = {
    "shot_prompts": ["A red fox trots through fresh snow in a pine forest at dawn",
                     "A neon-lit city street at night in the rain"],
    "shot_durations": [2, 2],
}
GEOMETRY = {"height": 256, "width": 256, "num_frames": 29, "seed": 0}

SUMMARY = re.compile(r"causalkv kv-cache summary: (.*)$", re.M)

#: the ports sglang 0.5.23's ``generate`` and ``serve`` take by default (ServerArgs fields):
#: the HTTP server (its ZMQ broker listens on ``port + 1``, its progress IPC socket is named
#: after ``port``), torch.distributed's rendezvous, the scheduler's ZMQ socket (5555 plus up to
#: 100). sglang probes each before binding it, seconds later in another process, so two
#: sglang starting at once can both pick a default and one fails with EADDRINUSE.
DEFAULT_PORTS = {"port": 30000, "master_port": 30005, "scheduler_port": 5555}

#: ports handed out by this process (two sglang starting at once must not share one)
_TAKEN: set[int] = set()
#: a folder shared by processes that hand out ports at the same time (the test suite's
#: workers): a port is handed out by the one process that creates its file there
PORT_REGISTRY = "CAUSALKV_PORT_REGISTRY"


def _claim(port: int) -> bool:
    """Claims ``port`` for this process, and across processes in ``$CAUSALKV_PORT_REGISTRY``."""
    if port in _TAKEN:
        return False
    registry = os.environ.get(PORT_REGISTRY)
    if registry:
        os.makedirs(registry, exist_ok=True)
        try:
            os.close(os.open(os.path.join(registry, str(port)), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return False
    _TAKEN.add(port)
    return True


def _quiet_ports() -> range:
    """Loopback ports the kernel never hands out by itself: those below Linux's ephemeral range
    (``ip_local_port_range``), where every outgoing connection and every bind to port 0 takes
    its port. A port chosen there stays free until something binds it by number, however long
    the sglang it is for takes to start; one chosen in the ephemeral range can be taken in the
    meantime by any connection on the machine. Empty where the range cannot be read."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return range(0)
    return range(10000, low - 1)  # low - 1: the port after the one chosen is in it too


def free_port() -> int:
    """A loopback port that is free, with the next one free too (sglang's HTTP server gives its
    broker ``port + 1``), neither handed out before, by this process or
    (``$CAUSALKV_PORT_REGISTRY``) by another, and neither one of sglang's defaults. Drawn at
    random from `_quiet_ports` (the kernel's choice where that is empty), so no connection
    takes it before sglang binds it, and two suites drawing at once rarely meet."""
    import random
    import socket

    quiet = _quiet_ports()
    defaults = {*DEFAULT_PORTS.values(), DEFAULT_PORTS["port"] + 1}
    draw = random.SystemRandom()  # not the seeded module generator: two clones draw apart
    for _ in range(100):
        if quiet:
            port = draw.choice(quiet)
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        if {port, port + 1} & defaults or not (bindable(port) and bindable(port + 1)):
            continue
        if not _claim(port):
            continue
        if not _claim(port + 1):
            continue  # the first stays claimed: never handed out, harmless
        return port
    raise RuntimeError("no two adjacent free loopback ports")


def bindable(port: int) -> bool:
    """Whether ``port`` can be bound on the loopback interface now."""
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports() -> dict[str, int]:
    """Free ports for every field of `DEFAULT_PORTS`: ``DiffGenerator.from_pretrained(**...)``
    takes them as they are, `port_flags` makes command-line flags of them."""
    return {name: free_port() for name in DEFAULT_PORTS}


def port_flags(ports: dict[str, int]) -> list[str]:
    """``--port P --master-port M --scheduler-port S`` for `free_ports`' dict."""
    return [arg for name, port in ports.items()
            for arg in (f"--{name.replace('_', '-')}", str(port))]


def cli_args(ckpt: Path, out: Path, name: str, *flags: str, shots: bool = True) -> list[str]:
    """The ``sglang generate`` command of `run_cli` (writes the shots config it names)."""
    args = [SGLANG, "generate", "--model-path", str(ckpt), "--model-id", "LongLive-2.0-5B",
            "--num-gpus", "1", "--output-path", str(out), "--output-file-name", name]
    for key, value in GEOMETRY.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    if shots:
        config = out / f"{name}-shots.json"
        config.write_text(json.dumps(SHOTS))
        args += ["--config", str(config)]
    else:
        args += ["--prompt", SHOTS["shot_prompts"][0]]
    return [*args, *flags]


#: what a log says when a port sglang was given got taken before it bound it (uvicorn, ZMQ,
#: torch.distributed's store): the run is tried again on fresh ports
PORT_TAKEN = re.compile(r"address already in use|EADDRINUSE", re.I)
#: runs of one command in all, when each finds a port of its own taken
PORT_TRIES = 3


def run_cli(ckpt: Path, out: Path, name: str, *flags: str, env: dict | None = None,
            shots: bool = True, timeout: int = 600) -> tuple[int, str, Path]:
    """``sglang generate`` on ``ckpt`` (the LongLive 2.0 request) on free ports (`free_ports`:
    another sglang on the machine cannot take them); (rc, log, video path).
    ``sglang generate`` exits 0 even when its request failed: read the log and the video.
    A run whose log says a port of its own was taken (`PORT_TAKEN`) is run again on fresh
    ports, `PORT_TRIES` runs in all; the log returned is the last run's."""
    for _ in range(PORT_TRIES):
        args = [*cli_args(ckpt, out, name, *flags, shots=shots), *port_flags(free_ports())]
        proc = subprocess.run(args, env={**os.environ, **(env or {})}, timeout=timeout,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if not PORT_TAKEN.search(proc.stdout):
            break
    return proc.returncode, proc.stdout, out / f"{name}.mp4"


def fields(text: str) -> dict[str, str]:
    """The ``key=value`` pairs of one log line."""
    return dict(kv.split("=", 1) for kv in text.split() if "=" in kv)


def summaries(log: str, *, skip: str | None = None) -> list[dict[str, str]]:
    """The bridge's ``causalkv kv-cache summary:`` lines of a log, as key=value dicts (lines
    containing ``skip`` before the summary left out)."""
    return [fields(m.group(1)) for m in SUMMARY.finditer(log)
            if skip is None or skip not in log[log.rfind("\n", 0, m.start()) + 1:m.start()]]


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of uint8-range frames ``a`` against ``b``."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def read_video(path: str | Path) -> np.ndarray:
    """Decode a saved video to ``[frames, H, W, 3]`` uint8."""
    import imageio.v3 as iio

    return np.asarray(iio.imread(str(path)))


def frames_of(result) -> np.ndarray:
    """The decoded frames of one DiffGenerator result as ``[frames, H, W, 3]`` uint8."""
    frames = result.frames
    if isinstance(frames, list):
        frames = np.stack([np.asarray(f) for f in frames])
    return np.asarray(frames)


@contextmanager
def fd_log(path: Path):
    """Send this process's fds 1 and 2 (and so its spawned workers') to ``path``; yield a
    callable returning what was written so far."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    try:
        yield lambda: path.read_text(errors="replace")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
