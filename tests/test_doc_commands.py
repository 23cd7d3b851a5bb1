"""Every command block of README.md and docs/*.md runs as written from a fresh clone after the
README's set-up, checked without running it: a ``make`` target exists in the Makefile, a
``causalkv`` command parses against the real parser, a script run by ``.venv/bin/python`` (or
``.venv-sglang/bin/python``) exists and declares every flag the line passes, and no line runs
a bare ``python`` (which on a fresh machine has neither torch nor causalkv). And the figures
the docs quote from ``causalkv memory`` are what it prints.

Blocks are the fences tagged ``bash``, ``sh``, ``shell`` or ``console`` (in ``console``
blocks the commands are the ``$ `` lines, the rest is output).
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: commands of other programs the docs show (installing, sglang's own CLI): not ours to parse
EXTERNAL = {"pip", "sglang"}
#: the interpreters the docs may run a script with, and what they are
INTERPRETERS = {".venv/bin/python": "make venv", ".venv-sglang/bin/python": "make venv-sglang"}


def blocks(text: str) -> list[tuple[str, str]]:
    """``(tag, body)`` of each fenced block tagged as shell."""
    return re.findall(r"^```(bash|sh|shell|console)\n(.*?)^```", text, re.M | re.S)


def block_commands(tag: str, body: str) -> list[list[str]]:
    """The block's commands as argv lists: ``\\``-continued lines joined, comments dropped;
    in a console block only the ``$ `` lines."""
    joined = re.sub(r"\\\n\s*", " ", body)
    lines = joined.splitlines()
    if tag == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    return [argv for line in lines if (argv := shlex.split(line, comments=True))]


def all_commands() -> list[tuple[str, list[str]]]:
    return [(path.relative_to(ROOT).as_posix(), argv)
            for path in DOCS for tag, body in blocks(path.read_text())
            for argv in block_commands(tag, body)]


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z0-9_.-]+):", text, re.M))


def _without_env(argv: list[str]) -> list[str]:
    """``PYTHONPATH=/x causalkv ...`` -> ``causalkv ...``."""
    while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
        argv = argv[1:]
    return argv


def _parse_causalkv(args: list[str]) -> None:
    """Parse ``args`` with the ``causalkv`` parser: a usage error fails (its message shown)."""
    from causalkv.cli.commands import build_parser

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            build_parser().parse_args(args)
        except SystemExit as exc:
            assert exc.code == 0, f"causalkv {shlex.join(args)}: {err.getvalue().strip()}"


def _script_flags(script: Path) -> set[str]:
    """The flags a script's argparse declares (``add_argument("--x", ...)``)."""
    return set(re.findall(r"""add_argument\(\s*["'](--[\w-]+)["']""", script.read_text()))


def check(argv: list[str], targets: set[str]) -> None:
    argv = _without_env(argv)
    head = argv[0]
    if head == "make":
        assert len(argv) == 2 and argv[1] in targets, f"{shlex.join(argv)}: no such Makefile target"
    elif head in ("causalkv", ".venv/bin/causalkv"):
        _parse_causalkv(argv[1:])
    elif head == "torchrun":  # torchrun ... -m causalkv ARGS
        i = argv.index("-m")
        assert argv[i + 1] == "causalkv", argv
        _parse_causalkv(argv[i + 2:])
    elif head in INTERPRETERS:
        script = ROOT / argv[1]
        assert script.is_file(), f"{shlex.join(argv)}: {argv[1]} does not exist"
        flags = {a.split("=", 1)[0] for a in argv[2:] if a.startswith("--")}
        missing = flags - _script_flags(script) - {"--help"}
        assert not missing, f"{shlex.join(argv)}: {argv[1]} takes no {sorted(missing)}"
    elif head in EXTERNAL:
        pass
    else:
        hint = " (say .venv/bin/python: a bare python has no torch nor causalkv)" if "python" in head else ""
        raise AssertionError(f"{shlex.join(argv)}: not a command a fresh clone runs{hint}")


def test_the_blocks_are_found() -> None:
    found = all_commands()
    heads = {_without_env(argv)[0] for _, argv in found}
    assert {"make", "causalkv", ".venv/bin/python", ".venv-sglang/bin/python"} <= heads, heads
    assert len(found) >= 25


@pytest.mark.parametrize(("where", "argv"), all_commands(), ids=lambda x: x if isinstance(x, str) else shlex.join(x)[:60])
def test_every_documented_command_runs_as_written(where: str, argv: list[str]) -> None:
    check(argv, makefile_targets())


def test_the_checker_refuses_what_a_fresh_clone_cannot_run() -> None:
    targets = makefile_targets()
    for bad in (["python", "benchmarks/generate.py", "--quick"],
                [".venv/bin/python", "benchmarks/generate.py", "--no-such-flag"],
                [".venv/bin/python", "benchmarks/nothing.py"],
                ["make", "no-such-target"],
                ["causalkv", "generate", "--no-such-flag"],
                ["causalkv", "memory", "longlive2", "[--json]"]):
        with pytest.raises(AssertionError):
            check(bad, targets)


def test_no_inline_command_runs_a_bare_python() -> None:
    """Inline code spans that run a script name the environment's interpreter too."""
    for path in DOCS:
        for span in re.findall(r"`([^`\n]+)`", path.read_text()):
            assert not re.match(r"^(PYTHONPATH=\S+ )?python3? (benchmarks|tests|demo)/", span), (path.name, span)


def test_untagged_fences_hold_no_command() -> None:
    """A command block is tagged (so the test above reads it)."""
    for path in DOCS:
        tag, body = None, []
        for line in path.read_text().split("\n"):
            if not line.startswith("```"):
                body.append(line)
                continue
            if tag is None:  # an opening fence (a closing one has no tag)
                tag, body = line[3:].strip(), []
                continue
            first = "\n".join(body).lstrip().split("\n", 1)[0]
            if not tag:
                assert not re.match(r"^(\$ |make |causalkv |\.venv|python )", first), (path.name, first)
            tag = None


# ---- figures quoted from `causalkv memory` ----------------------------------------------------
def _plan(argv: list[str]) -> dict[str, dict[str, float]]:
    """``causalkv memory ARGV --json``'s rows by setting (the command as documented)."""
    import json

    from causalkv.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["memory", *argv, "--json"]) == 0
    data = json.loads(out.getvalue())
    rows = data["rows"] if isinstance(data, dict) else data
    return {r["setting"]: r for r in rows}


def _ratios(row: dict[str, float]) -> tuple[float, float]:
    return row["peak_bytes"] / row["dense_bytes"], row["kv_bytes"] / row["dense_bytes"]


def test_readme_quotes_the_planner_for_both_request_sizes() -> None:
    text = " ".join((ROOT / "README.md").read_text().split())
    full = _plan(["longlive2", "--latent-frames", "48", "--shots", "2"])["int2-recent0"]
    half = _plan(["longlive2", "--frames", "61"])["int2-recent0"]
    assert "`causalkv memory longlive2 --latent-frames 48 --shots 2`" in text
    assert f"peaks at {_ratios(full)[0]:.3f} of sglang's dense cache once the window is full" in text
    assert f"int2-recent0 peaks at {_ratios(half)[0]:.3f} of a dense cache" in text
    assert f"reads the {_ratios(full)[0]:.3f} above" in text


def test_benchmarks_longlive2_table_is_the_planners() -> None:
    """The LongLive 2.0 ``--layers`` table's byte ratios are `causalkv memory`'s for the same
    request (6 chunks, two shots, a full window)."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    assert "`causalkv memory longlive2 --latent-frames 48 --shots 2`" in " ".join(text.split())
    section = text[text.index("LongLive 2.0 at its real geometry"):text.index("LingBot-World (40 layers")]
    rows = re.findall(r"^\| ([\w-]+) \| ([\d.]+) \| ([\d.]+) \|", section, re.M)
    plan = _plan(["longlive2", "--latent-frames", "48", "--shots", "2"])
    assert len(rows) == 11  # off, int2 x 4, int4 x 2, fp8 x 2, nvfp4 x 2
    for setting, peak, resident in rows:
        want = _ratios(plan[setting])
        assert (peak, resident) == (f"{want[0]:.3f}", f"{want[1]:.3f}"), setting


def test_benchmarks_quotes_make_runs_ratios_from_the_planner() -> None:
    text = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    row = _plan(["tiny-longlive2-1k", "--host", "causalkv", "--cfg", "--latent-frames", "24",
                 "--shots", "2", "--setting", "int2-recent0"])["int2-recent0"]
    resident = row["dense_bytes"] / row["kv_bytes"]
    peak = row["dense_bytes"] / row["peak_bytes"]
    assert (f"`make run`: {resident:.2f}x less KV resident, {peak:.2f}x less at the peak; the same "
            "bytes as `causalkv memory tiny-longlive2-1k --host causalkv --cfg --latent-frames 24 "
            "--shots 2 --setting int2-recent0`") in text


def test_design_md_quotes_the_dense_bytes_in_gib() -> None:
    """docs/design.md's memory math in binary units, the planner's dense_bytes for LongLive 2.0."""
    text = " ".join((ROOT / "docs" / "design.md").read_text().split())
    dense = _plan(["longlive2", "--latent-frames", "32", "--setting", "off"])["off"]["dense_bytes"]
    assert dense == 368_640 * 28_160
    assert f"(28,160 tokens) = {dense / 2**30:.2f} GiB per cache" in text
    assert f"{2 * dense / 2**30:.2f} GiB with the CFG branch's cache" in text
    assert " GB" not in text.split("## Memory math")[1].split("##")[0]
