"""Every sglang process the tests start takes free ports, so the suite passes while another
sglang runs on the machine (conftest's ``default_ports_taken`` holds sglang's default ports
for the whole session, as that other sglang would).

sglang 0.5.23 probes its default ports (ServerArgs: HTTP 30000 and its broker 30001, master
30005, scheduler 5555 plus up to 100) in the process that parses the arguments and binds them
seconds later in its worker, so two sglang starting at once can pick the same default and one
fails with EADDRINUSE. The ports given here are the kernel's choice, handed out once per
session.
"""

from __future__ import annotations

import socket

from longlive2_request import DEFAULT_PORTS, free_ports, port_flags


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_the_default_ports_are_taken_during_the_session(default_ports_taken):
    """Each default port is held by this session (so not bindable now), or was held by someone
    else when the session began (another worker or clone, whose hold may end before ours)."""
    held, busy = default_ports_taken
    for port in (DEFAULT_PORTS["port"], DEFAULT_PORTS["master_port"], DEFAULT_PORTS["scheduler_port"]):
        assert port in held or port in busy, port
        if port in held:
            assert not _bindable(port), port


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
