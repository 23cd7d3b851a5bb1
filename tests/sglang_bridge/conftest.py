"""tests/sglang_bridge runs in the sglang environment only (`make test-sglang`, its run.py).

The main environment has no sglang: there these modules are not collected (they run in the
same `make test`, in .venv-sglang, right after the main suite). ``demo/sglang`` (the CPU
demo's request, `longlive2_request`, which the end-to-end tests share) goes on ``sys.path``.
"""

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

_DEMO = str(Path(__file__).resolve().parents[2] / "demo" / "sglang")
if _DEMO not in sys.path:
    sys.path.insert(0, _DEMO)

if importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["test_*.py"]

# `make test` runs these files two at a time (pytest-xdist): the workers hand out ports through
# one registry, so two sglang started by two workers never get the same free port
if "PYTEST_XDIST_TESTRUNUID" in os.environ:
    from longlive2_request import PORT_REGISTRY

    os.environ.setdefault(PORT_REGISTRY, os.path.join(
        tempfile.gettempdir(), f"causalkv-ports-{os.environ['PYTEST_XDIST_TESTRUNUID']}"))


def _build(name: str, tmp_path_factory):
    from causalkv.runtime.tools.checkpoints import build_checkpoint

    return build_checkpoint(name, tmp_path_factory.mktemp("sglang-checkpoints") / name)


if importlib.util.find_spec("sglang") is not None:
    import pytest

    @pytest.fixture(scope="session", autouse=True)
    def default_ports_taken():
        """Something else listens on sglang's default ports for the whole session, as another
        sglang on the machine would: every sglang the tests start must run on ports of its own
        (`longlive2_request.free_ports`). Yields ``(held, busy)``: the ports held here for the
        session, and those someone else held when it began (another xdist worker, or another
        clone's suite, which may let them go before this session ends)."""
        import socket

        from longlive2_request import DEFAULT_PORTS

        wanted = {DEFAULT_PORTS["port"], DEFAULT_PORTS["port"] + 1, DEFAULT_PORTS["master_port"],
                  # the scheduler's default is 5555 plus up to 100
                  *range(DEFAULT_PORTS["scheduler_port"], DEFAULT_PORTS["scheduler_port"] + 101)}
        held, busy = [], []
        for port in sorted(wanted):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
                s.listen()
            except OSError:
                s.close()
                busy.append(port)
                continue
            held.append(s)
        try:
            yield [s.getsockname()[1] for s in held], busy
        finally:
            for s in held:
                s.close()

    @pytest.fixture(scope="session")
    def longlive2_checkpoint(tmp_path_factory):
        """The tiny LongLive 2.0 checkpoint in sglang's format, built once per session."""
        return _build("longlive2", tmp_path_factory)

    @pytest.fixture(scope="session")
    def wan_causal_checkpoint(tmp_path_factory):
        """The tiny Wan causal DMD checkpoint in sglang's format, built once per session."""
        return _build("wan-causal", tmp_path_factory)

    @pytest.fixture(scope="session")
    def lingbot_checkpoint(tmp_path_factory):
        """The tiny LingBot-World checkpoint in sglang's format, built once per session."""
        return _build("lingbot", tmp_path_factory)
