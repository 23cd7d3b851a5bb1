"""Messages that tell the truth: what ``causalkv resolve`` and ``causalkv demo`` refuse, what
a load that runs out of memory says, and the run header's centroid line against the metrics."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
from fault_helpers import ChunkCounter, files, one_line, run_cli

from causalkv.runtime.model_io.components import LoadMemoryError, reading_component
from causalkv.runtime.model_io.model_config import ModelFolderError


@pytest.mark.parametrize(("argv", "line"), [
    (["resolve", "tiny-wan", "--kv-cache-quant", "int2", "--kv-cache-quant-block-size", "12"],
     "causalkv resolve: error: kv-cache-quant-block-size 12 does not divide head_dim=64; choose one of "
     "[4, 8, 16, 32, 64]"),
    (["resolve", "tiny-wan", "--kv-cache-quant", "int2", "--kv-cache-quant-block-size", "7"],
     "causalkv resolve: error: kv-cache-quant-block-size 7 x 2 bits is not a whole number of bytes; use a "
     "block size divisible by 4"),
    (["demo", "--cuts", "100"],
     "causalkv demo: error: --cuts 100: 100 is not a chunk index in 1..8 (chunk 0 starts the stream, "
     "--chunks 9 ends it); see causalkv demo --help"),
    (["demo", "--cuts", "3,3"], "causalkv demo: error: --cuts 3,3: a chunk is listed twice; see causalkv demo --help"),
])
def test_refusals_of_the_other_commands_are_one_line_exit_2(
    argv: list[str], line: str, capsys: pytest.CaptureFixture[str], counter: ChunkCounter,
) -> None:
    rc = run_cli(argv)
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    assert one_line(captured.err) == line


def test_resolve_of_a_bare_served_name_says_generate_needs_weights(
    capsys: pytest.CaptureFixture[str], counter: ChunkCounter,
) -> None:
    assert run_cli(["resolve", "SelfForcingWanPipeline", "--kv-cache-quant", "int2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2:] == [
        "note: 'SelfForcingWanPipeline' has no transformer config here: the block size is checked against "
        "head_dim when causalkv generate reads one",
        "note: 'SelfForcingWanPipeline' is a served model name, not a preset or a model folder: causalkv "
        "generate needs a preset or a folder to load weights from",
    ]


@pytest.mark.parametrize(("exc", "kind"), [
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you "
                  "tried to allocate 512000000000000 bytes"), LoadMemoryError),
    (MemoryError(), LoadMemoryError),
    (OSError("unable to open file"), ModelFolderError),
])
def test_a_load_that_runs_out_of_memory_is_not_called_corrupt(exc: BaseException, kind: type, tmp_path: Path) -> None:
    with pytest.raises(kind) as info, reading_component(tmp_path, "transformer"):
        raise exc
    text = str(info.value)
    if kind is LoadMemoryError:
        assert info.value.exit_code == 1
        assert text.startswith(f"loading transformer from '{tmp_path}/transformer' ran out of memory (")
        assert "re-download" not in text
    else:
        assert "restore the component's files (re-download or re-convert the model)" in text


def test_header_says_which_centroids_the_chunks_get_as_the_metrics_count(
    causalkv_home: str, tmp_path: Path, counter: ChunkCounter, capsys: pytest.CaptureFixture[str],
) -> None:
    m = tmp_path / "m.json"
    rc = run_cli(["generate", "--quiet", "--dtype", "float32", "--frames", "6", "--kv-cache-quant", "int2",
                  "--kv-cache-quant-keep-recent", "0", "--no-video", "--metrics", str(m)])
    out = capsys.readouterr().out
    assert rc == 0
    said = re.search(r"  - centroids: (\d+) per packed span of (\d+) tokens \(at most 128; a span of S tokens "
                     r"gets min\(128, 2\*\*floor\(log2\(S / 32\)\)\)", out)
    assert said is not None, out
    # tiny-wan: 3 frames x 16 tokens = 48 tokens per chunk -> 2**floor(log2(48 // 32)) = 1
    assert said.groups() == ("1", "48")
    packing = json.loads(m.read_text())["kv_packing"]
    assert set(packing["centroids"]) == {said.group(1)} and files(tmp_path) == {"m.json"}
    assert packing["chunks_packed"] >= 1


def test_no_command_reads_a_flag_prefix_as_another_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """Every parser of the ``causalkv`` command takes flags whole (``allow_abbrev=False``): a
    prefix is an unknown argument, never the flag it starts (``causalkv memory --kv-cache-quant
    int8`` was read as ``--kv-cache-quant-sink int8``: "must be 0 or 1, got 'int8'")."""
    from causalkv.cli.commands import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    parsers = {"causalkv": parser, **sub.choices}
    assert set(parsers) >= {"causalkv", "generate", "memory", "plugins", "resolve", "demo"}
    assert {name for name, p in parsers.items() if p.allow_abbrev} == set()
    for argv, typed in ((["memory", "longlive2", "--kv-cache-quant-s", "0"], "--kv-cache-quant-s 0"),
                        (["generate", "--kv-cache-q", "int2"], "--kv-cache-q int2"),
                        (["resolve", "tiny-wan", "--kv-cache-quant-keep", "0"], "--kv-cache-quant-keep 0")):
        assert run_cli(argv) == 2
        assert one_line(capsys.readouterr().err) == (
            f"causalkv: error: unrecognized arguments: {typed}; see causalkv --help")
