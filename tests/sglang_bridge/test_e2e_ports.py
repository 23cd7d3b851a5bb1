"""Every sglang process the tests start takes free ports, so the suite passes while another
sglang runs on the machine (conftest's ``default_ports_taken`` holds sglang's default ports
for the whole session, as that other sglang would).

sglang 0.5.23 probes its default ports (ServerArgs: HTTP 30000 and its broker 30001, master
30005, scheduler 5555 plus up to 100) in the process that parses the arguments and binds them
seconds later in its worker, so two sglang starting at once can pick the same default and one
fails with EADDRINUSE. The ports given here are drawn below the kernel's ephemeral range (no
connection takes one before sglang binds it), handed out once per session, and a server that
finds one taken all the same is started again on fresh ports.
"""

from __future__ import annotations

from pathlib import Path

import e2e
import pytest
from longlive2_request import DEFAULT_PORTS, PORT_TRIES, bindable, free_ports, port_flags


def test_the_default_ports_are_taken_during_the_session(default_ports_taken):
    """Each default port is held by this session (so not bindable now), or was held by someone
    else when the session began (another worker or clone, whose hold may end before ours)."""
    held, busy = default_ports_taken
    for port in (DEFAULT_PORTS["port"], DEFAULT_PORTS["master_port"], DEFAULT_PORTS["scheduler_port"]):
        assert port in held or port in busy, port
        if port in held:
            assert not bindable(port), port


def test_sglang_takes_the_free_ports_from_the_command_line_and_the_python_api(longlive2_checkpoint):
    """sglang's own parser of ``sglang generate``/``serve``'s flags reads `port_flags` into the
    ServerArgs fields, and ``DiffGenerator.from_pretrained``'s ServerArgs (from_kwargs) keeps
    the ports given: none of them a default, none handed out twice."""
    from sglang.multimodal_gen.runtime.server_args import ServerArgs
    from sglang.multimodal_gen.runtime.utils.argparse import FlexibleArgumentParser

    model = ["--model-path", str(longlive2_checkpoint), "--model-id", "LongLive-2.0-5B",
             "--num-gpus", "1"]
    cli, api = free_ports(), free_ports()
    parsed = ServerArgs.add_cli_args(FlexibleArgumentParser()).parse_args(
        [*model, *port_flags(cli)])
    assert {name: getattr(parsed, name) for name in DEFAULT_PORTS} == cli
    # ServerArgs settles its ports at construction: free ones are kept as given
    args = ServerArgs.from_kwargs(model_path=str(longlive2_checkpoint),
                                  model_id="LongLive-2.0-5B", num_gpus=1, **api)
    assert {name: getattr(args, name) for name in DEFAULT_PORTS} == api
    assert args.broker_port == api["port"] + 1
    given = [*cli.values(), *api.values()]
    given += [p + 1 for p in given]  # each port comes with the next one free
    assert len(set(given)) == len(given)
    assert not set(given) & {*DEFAULT_PORTS.values(), DEFAULT_PORTS["port"] + 1}


def test_the_ports_given_are_ones_the_kernel_never_hands_out_by_itself():
    """Every port `free_ports` gives, and the one after it, lies below the kernel's ephemeral
    range (``ip_local_port_range``: where outgoing connections and binds to port 0 take their
    ports), so nothing takes it between the draw and sglang's bind but a bind by number."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    given = [port for _ in range(20) for port in free_ports().values()]
    assert len(set(given)) == len(given)
    assert all(1024 <= port and port + 1 < low for port in given), (low, given)


#: a stand-in for the ``sglang`` command: each run appends its ``--port`` to ``runs.txt``
#: beside it; the first ``TAKEN`` runs fail as sglang did in CI when a port given to it was
#: taken before it bound it (uvicorn's own line, quoted from that log), later runs serve
FAKE_SGLANG = """#!{python}
import sys, time
from pathlib import Path
runs = Path(__file__).with_name("runs.txt")
port = sys.argv[sys.argv.index("--port") + 1]
with runs.open("a") as f:
    f.write(port + "\\n")
if len(runs.read_text().split()) <= {taken}:
    print("[2026-12-07 07:55:06] ERROR:    [Errno 98] error while attempting to bind on "
          "address ('127.0.0.1', " + port + "): address already in use", flush=True)
    sys.exit(0)
print("Uvicorn running on http://127.0.0.1:" + port + " (Press CTRL+C to quit)", flush=True)
if sys.argv[1] == "serve":
    time.sleep(60)
"""


def _fake_sglang(folder: Path, taken: int) -> Path:
    import sys

    path = folder / "sglang"
    path.write_text(FAKE_SGLANG.format(python=sys.executable, taken=taken))
    path.chmod(0o755)
    return path


def _runs(folder: Path) -> list[int]:
    return [int(p) for p in (folder / "runs.txt").read_text().split()]


def test_a_server_whose_port_was_taken_before_it_bound_starts_again_on_fresh_ports(tmp_path):
    """`RealtimeServer.wait_ready`: a server that exits saying a port of its own was taken is
    started again on ports drawn anew, and its ready port is the new start's."""
    fake = _fake_sglang(tmp_path, taken=1)
    server = e2e.RealtimeServer(tmp_path, tmp_path / "server", model_id="m")
    server.args[0] = str(fake)
    try:
        port = server.start().wait_ready(timeout=60)
    finally:
        server.stop()
    first, second = _runs(tmp_path)
    assert server.starts == 2 and port == second != first


def test_a_server_gives_up_after_its_tries(tmp_path):
    """Each start finding a port taken: `PORT_TRIES` starts, then the refusal with the log."""
    fake = _fake_sglang(tmp_path, taken=PORT_TRIES)
    server = e2e.RealtimeServer(tmp_path, tmp_path / "server", model_id="m")
    server.args[0] = str(fake)
    with pytest.raises(RuntimeError, match="address already in use"):
        server.start().wait_ready(timeout=60)
    server.stop()
    assert len(set(_runs(tmp_path))) == PORT_TRIES


def test_sglang_generate_whose_port_was_taken_runs_again_on_fresh_ports(tmp_path, monkeypatch):
    """`run_cli` (``make run-sglang``'s and the CLI tests' runner) runs ``sglang generate``
    again on fresh ports when its log says a port was taken, and returns that run's log."""
    import longlive2_request

    monkeypatch.setattr(longlive2_request, "SGLANG", str(_fake_sglang(tmp_path, taken=1)))
    rc, log, _ = longlive2_request.run_cli(tmp_path, tmp_path, "video")
    first, second = _runs(tmp_path)
    assert rc == 0 and first != second
    assert f"http://127.0.0.1:{second} " in log and "already in use" not in log
