"""Helpers of the end-to-end tests: sglang's own entry points on the tiny sglang checkpoints.

Every process these tests start inherits ``PYTHONPATH`` from ``run.py`` (the CPU stand-ins).
``sglang generate`` exits 0 even when its request failed, so the tests read the outputs and
the worker's log, never the exit code alone. The LongLive 2.0 request itself (`GEOMETRY`,
`SHOTS`, ``run_cli``) and the readers of its outputs are the CPU demo's
(``demo/sglang/longlive2_request.py``, on ``sys.path`` through conftest.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from longlive2_request import (
    GEOMETRY,
    PORT_TAKEN,
    PORT_TRIES,
    SGLANG,
    SHOTS,
    fields,
    free_ports,
    port_flags,
)
from longlive2_request import summaries as request_summaries

from causalkv.memory import ROLLING_SLOT_CACHE, MemoryRequest, plan_memory
from causalkv.runtime.model_io.geometry import read_model_geometry

#: what `realtime_probe` prints (its lines quote a summary line, which `summaries` skips)
PROBE_PREFIX = "causalkv test probe: "


def summaries(log: str) -> list[dict[str, str]]:
    """The bridge's ``causalkv kv-cache summary:`` lines of a log, as key=value dicts (the
    realtime probe's quotes of them left out)."""
    return request_summaries(log, skip=PROBE_PREFIX)


def probe_records(log: str) -> list[dict[str, str]]:
    """`realtime_probe`'s lines of a log (one per realtime chunk), as key=value dicts: the
    stream's cursors and the bridge's summary fields for the session's caches."""
    return [fields(line.split(PROBE_PREFIX, 1)[1].replace("| causalkv kv-cache summary:", ""))
            for line in log.splitlines() if PROBE_PREFIX in line]


def serving_lines(log: str) -> list[str]:
    """The bridge's allocation lines (which cache serves a stage) of a log."""
    return [line for line in log.splitlines() if "causalkv sglang bridge: " in line
            and (" blocks, served by " in line or "keeps sglang's dense KV cache" in line)]


# ---- sglang's realtime server (``sglang serve``, its /v1/realtime_video/generate websocket) ----
#: the realtime request's geometry on the tiny LingBot-World checkpoint: 1x1 patches and an 8x
#: VAE give 256 tokens per latent frame at 128x128, a chunk is 3 latent frames (768 tokens;
#: the first chunk decodes to 9 video frames, every later one to 12)
REALTIME_SIZE = (128, 128)
_READY = re.compile(r"Uvicorn running on \S*?http://127\.0\.0\.1:(\d+)")


class RealtimeServer:
    """``sglang serve`` on the loopback interface, started as its own process group.

    Args:
        ckpt: the model folder; ``model_id`` the registered model sglang takes its configs from.
        workdir: the server's working directory (sglang writes uploaded first frames there).
        flags: more ``sglang serve`` flags (``--kv-cache-quant int2``).
        env: environment overrides; a ``None`` value removes the variable.
    """

    def __init__(self, ckpt: Path, workdir: Path, *flags: str, model_id: str,
                 env: dict[str, str | None] | None = None) -> None:
        # --sleep-on-idle: an idle CPU worker otherwise spins a core polling for requests
        # (10 CPU seconds in 10 s measured), which would starve the session in progress.
        # Every port given (`free_ports`, drawn at each start): sglang's defaults are probed
        # before they are bound, so two servers starting at once would race for them
        self.args = [SGLANG, "serve", "--model-path", str(ckpt), "--model-id", model_id,
                     "--num-gpus", "1", "--host", "127.0.0.1", "--warmup-mode", "off",
                     "--sleep-on-idle", *flags]
        self.workdir = workdir
        self.log_path = workdir / "server.log"
        self.env = {k: v for k, v in os.environ.items()}
        for key, value in (env or {}).items():
            if value is None:
                self.env.pop(key, None)
            else:
                self.env[key] = value
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.starts = 0

    def start(self) -> RealtimeServer:
        """Starts the server on ports drawn now (`free_ports`), logging to `log_path`."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([*self.args, *port_flags(free_ports())], cwd=self.workdir,
                                         env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        self.starts += 1
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_ready(self, timeout: float = 300) -> int:
        """Block until uvicorn listens; the port it listens on (sglang may pick another).
        A server that exited because a port of its own was taken before it bound it
        (`PORT_TAKEN`) is started again on fresh ports, `PORT_TRIES` starts in all."""
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = _READY.search(self.log())
            if m:
                self.port = int(m.group(1))
                return self.port
            if self.proc is None or self.proc.poll() is not None:
                log = self.log()
                if self.proc is None or not PORT_TAKEN.search(log) or self.starts >= PORT_TRIES:
                    raise RuntimeError(f"sglang serve exited before listening:\n{log[-3000:]}")
                self.start()
            time.sleep(0.25)
        raise TimeoutError(f"sglang serve not listening after {timeout} s:\n{self.log()[-3000:]}")

    def wait_for(self, text: str, count: int = 1, timeout: float = 60) -> None:
        """Block until ``text`` is in the log ``count`` times (sglang logs some things after a
        session's websocket closed, e.g. its release)."""
        import time

        deadline = time.monotonic() + timeout
        while self.log().count(text) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{text!r} not logged {count} times in {timeout} s:\n"
                                   f"{self.log()[-3000:]}")
            time.sleep(0.1)

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM to the server's process group (uvicorn shuts down, the worker follows),
        then SIGKILL whatever is left after ``timeout`` seconds."""
        import signal

        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the group is the server's own
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(pgid, signal.SIGKILL)  # the worker and any straggler of the group
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc = None


@dataclass
class RealtimeStream:
    """What one realtime session sent back.

    Attributes:
        chunks: the decoded frames of each chunk in order, ``[frames, H, W, 3]`` uint8.
        stats: the ``chunk_stats`` messages.
        errors: the ``error`` messages' contents.
        closed: how the websocket closed (code and reason).
    """

    chunks: list[np.ndarray] = field(default_factory=list)
    stats: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    closed: str = ""

    @property
    def frames(self) -> np.ndarray:
        """Every chunk's frames, ``[frames, H, W, 3]``."""
        return np.concatenate(self.chunks) if self.chunks else np.zeros((0, 0, 0, 3), np.uint8)


def realtime_init(ckpt: Path, *, max_chunks: int, actions: bool = True, seed: int = 0) -> dict:
    """The ``init`` message of a LingBot-World realtime session: the checkpoint's first frame
    (PNG bytes: the websocket carries no multipart upload), its camera actions
    (``camera_actions.json``'s one list of WASD/IJKL keys per frame, as a script in
    ``condition_inputs``), ``max_chunks`` chunks, noise drawn on the CPU."""
    init = {"type": "init", "prompt": SHOTS["shot_prompts"][0],
            "first_frame": (ckpt / "first_frame.png").read_bytes(),
            "size": f"{REALTIME_SIZE[1]}x{REALTIME_SIZE[0]}", "max_chunks": max_chunks,
            "seed": seed, "generator_device": "cpu"}
    if actions:
        camera = json.loads((ckpt / "camera_actions.json").read_text())["actions"]
        init["condition_inputs"] = {"camera_actions": camera}
    return init


def realtime_stream(port: int, init: dict, *, timeout: float = 300) -> RealtimeStream:
    """One session on sglang's ``/v1/realtime_video/generate``: send ``init``, read until the
    server closes. Frame batches come as one ``frame_batch`` message, or (payloads of 64 KiB
    and more) a ``frame_batch_header`` followed by the raw RGB bytes."""
    import msgspec.msgpack
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    out = RealtimeStream()
    parts: dict[int, list[np.ndarray]] = {}
    with connect(f"ws://127.0.0.1:{port}/v1/realtime_video/generate", max_size=None,
                 open_timeout=60, close_timeout=10) as ws:
        ws.send(msgspec.msgpack.encode(init))
        header = None
        try:
            while True:
                message = ws.recv(timeout=timeout)
                if header is not None:
                    payload, batch, header = message, header, None
                else:
                    data = msgspec.msgpack.decode(message)
                    kind = data.get("type")
                    if kind == "frame_batch_header":
                        header = data
                        continue
                    if kind == "chunk_stats":
                        out.stats.append(data)
                    elif kind == "error":
                        out.errors.append(str(data.get("content")))
                    if kind != "frame_batch":
                        continue
                    payload, batch = data.pop("payload"), data
                h, w, c = int(batch["height"]), int(batch["width"]), int(batch["channels"])
                frames = np.frombuffer(payload, np.uint8).reshape(int(batch["num_frames"]), h, w, c)
                parts.setdefault(int(batch["chunk_index"]), []).append(frames)
        except ConnectionClosed as closed:
            frame = closed.rcvd  # the server's close frame (None: closed without one)
            out.closed = "no close frame" if frame is None else f"{frame.code} {frame.reason}"
    out.chunks = [np.concatenate(parts[i]) for i in sorted(parts)]
    return out


# ---- `causalkv memory` against a run's summary line -----------------------------------------
def planner_matches(longlive2_checkpoint, log: str, setting: str) -> None:
    """The planner's row for ``setting`` on the folder (the end-to-end two-shot request)
    equals the summary line of ``log``: peak, resident and dense bytes."""
    (s,) = summaries(log)
    geom = read_model_geometry(longlive2_checkpoint)
    req = MemoryRequest(height=GEOMETRY["height"], width=GEOMETRY["width"],
                        frames=GEOMETRY["num_frames"], shots=len(SHOTS["shot_prompts"]))
    (row,) = plan_memory(geom, req, ROLLING_SLOT_CACHE, settings=[setting]).rows
    assert (int(s["peak_bytes"]), int(s["resident_bytes"]), int(s["dense_bytes"])) == (
        row.peak_bytes, row.kv_bytes, row.dense_bytes)
