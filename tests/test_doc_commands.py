"""Every command block of README.md and docs/*.md runs as written from a fresh clone after the
README's set-up, checked without running it: a ``make`` target exists in the Makefile, a
``causalkv`` command parses against the real parser, a script run by ``.venv/bin/python`` (or
``.venv-sglang/bin/python``) exists and declares every flag the line passes, and no line runs
a bare ``python`` (which on a fresh machine has neither torch nor causalkv). And the figures
the docs attribute to a command are what the command gives, run in this process: the README's,
docs/benchmarks.md's and docs/design.md's from ``causalkv memory``; docs/usage.md's output of
``causalkv memory``, its row names, its "Measured" bytes (a ``causalkv generate`` run and the
planner) and its example runs' metrics, and its flag table against ``causalkv generate``'s
parser.

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


# ---- docs/usage.md: what `causalkv memory` and `causalkv generate` print ----------------------
USAGE = ROOT / "docs" / "usage.md"


def console_outputs(text: str) -> list[tuple[list[str], list[str]]]:
    """``(argv, output lines)`` of each ``$ `` command of a console block that shows output."""
    shown: list[tuple[list[str], list[str]]] = []
    for tag, body in blocks(text):
        if tag != "console":
            continue
        for line in body.splitlines():
            if line.startswith("$ "):
                shown.append((shlex.split(line[2:], comments=True), []))
            elif shown:
                shown[-1][1].append(line)
    return [(argv, out) for argv, out in shown if out]


def _cli(argv: list[str]) -> str:
    """``causalkv ARGV``'s stdout, run in this process (exit status 0)."""
    from causalkv.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0, shlex.join(argv)
    return out.getvalue()


@pytest.fixture
def one_thread():
    """Torch on one thread while a tiny generation runs (a busy 2-core machine: two threads
    made each step tens of times slower); restored afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _generate(argv: list[str], tmp_path: Path) -> dict:
    """The metrics of ``causalkv generate ARGV`` as the doc writes it, run in this process with
    the files it writes moved under ``tmp_path`` (``--metrics``) and no video."""
    import json

    argv = list(argv)
    for flag in ("--metrics", "--output"):
        if flag in argv:
            i = argv.index(flag)
            del argv[i : i + 2]
    metrics = tmp_path / "metrics.json"
    _cli([*argv[1:], "--no-video", "--quiet", "--metrics", str(metrics)])
    return json.loads(metrics.read_text())


def _bash_example(text: str, head: str) -> tuple[list[str], dict[str, str]]:
    """The bash block whose command starts with ``head``: its argv (``causalkv ...``) and its
    ``# key: value`` comment lines."""
    for tag, body in blocks(text):
        if tag == "bash" and re.sub(r"\\\n\s*", " ", body).startswith(head):
            (argv,) = block_commands(tag, body)
            notes = dict(re.findall(r"^# (\w+): (.*)$", body, re.M))
            return argv, notes
    raise AssertionError(f"no bash block starts with {head!r}")


def test_console_outputs_reads_the_lines_after_a_command() -> None:
    text = "```console\n$ causalkv memory x   # note\nrow 1\nrow 2\n$ causalkv plugins\n```\n"
    assert console_outputs(text) == [(["causalkv", "memory", "x"], ["row 1", "row 2"])]


def test_usage_md_shows_what_causalkv_memory_prints() -> None:
    shown = [(argv, out) for argv, out in console_outputs(USAGE.read_text())
             if argv[:2] == ["causalkv", "memory"]]
    assert shown, "usage.md shows no causalkv memory output"
    for argv, out in shown:
        assert _cli(argv[1:]).splitlines() == out, shlex.join(argv)


def test_usage_md_names_the_rows_causalkv_memory_prints() -> None:
    from causalkv.memory.records import SETTINGS

    text = " ".join(USAGE.read_text().split())
    listed = re.search(r"The rows are (.*?) \(the names", text)
    assert listed is not None
    assert re.findall(r"`([\w-]+)`", listed.group(1)) == list(SETTINGS)
    words = {"eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14}
    count = re.search(r"one row per setting, (\w+) in all", text)
    assert count is not None and words.get(count.group(1)) == len(SETTINGS)


def test_usage_md_measured_bytes_are_the_runs_and_the_planners(
    causalkv_home: str, tmp_path: Path, one_thread: None
) -> None:
    """"Measured:": the generate run's per-chunk and peak KV bytes, and the planner's for the
    same request; and the planner's for the sglang checkpoint the paragraph names (the sglang
    run's own log line is checked in the sglang environment, tests/sglang_bridge/e2e.py)."""
    text = " ".join(USAGE.read_text().split())
    m = re.search(
        r"Measured: `(causalkv generate [^`]+)` reports `kv_resident_bytes_per_chunk` ([\d,]+) "
        r"\.\.\. ([\d,]+) and `kv_peak_bytes` ([\d,]+), what `(causalkv memory [^`]+)` gives "
        r"for `([\w-]+)` as `kv_bytes`", text)
    assert m is not None
    first, last, peak = (int(g.replace(",", "")) for g in m.group(2, 3, 4))
    row = _plan(shlex.split(m.group(5))[2:])[m.group(6)]
    assert (row["kv_bytes"], row["peak_bytes"]) == (last, peak)
    run = _generate(shlex.split(m.group(1)), tmp_path)
    per_chunk = run["kv_resident_bytes_per_chunk"]
    assert (per_chunk[0], max(per_chunk), per_chunk[-1], run["kv_peak_bytes"]) == (
        first, last, last, peak)

    s = re.search(
        r"`causalkv (sglang-checkpoint \w+)` \([^)]*\) logs `peak_bytes=(\d+) resident_bytes=(\d+) "
        r"dense_bytes=(\d+)`, what `causalkv memory DIR ([^`]+)` gives for `([\w-]+)`", text)
    assert s is not None
    folder = tmp_path / "checkpoint"
    _cli([*s.group(1).split(), str(folder)])
    row = _plan([str(folder), *shlex.split(s.group(5))])[s.group(6)]
    assert (row["peak_bytes"], row["kv_bytes"], row["dense_bytes"]) == tuple(
        int(g) for g in s.group(2, 3, 4))


def test_usage_md_longlive2_shots_example_is_what_the_run_reports(
    causalkv_home: str, tmp_path: Path, one_thread: None
) -> None:
    import json

    argv, notes = _bash_example(USAGE.read_text(), "causalkv generate --model tiny-longlive2 ")
    assert set(notes) == {"chunk_prompts", "pinned_chunks", "rope_frame_start_per_chunk"}
    run = _generate(argv, tmp_path)
    for key, shown in notes.items():
        assert run[key] == json.loads(shown), key


def test_usage_md_lingbot_motion_example_is_what_the_run_reports(
    causalkv_home: str, tmp_path: Path, one_thread: None
) -> None:
    argv, notes = _bash_example(USAGE.read_text(), "causalkv generate --model tiny-lingbot ")
    run = _generate(argv, tmp_path)
    windows = ", ".join(f"{w['mode']} {w['frames']}" for w in run["kv_window_per_chunk"])
    assert notes["kv_window_per_chunk"] == windows


def test_usage_md_flag_table_is_generates_flags() -> None:
    """Every flag of ``causalkv generate`` has a row (``-x`` in the QVG settings' row stands
    for ``--kv-cache-quant-x``), and a row that shows choices shows the parser's."""
    from causalkv.cli.commands import build_parser

    sub = next(a for a in build_parser()._actions if a.choices and "generate" in a.choices)
    flags = {o: a for a in sub.choices["generate"]._actions for o in a.option_strings
             if o.startswith("--") and o != "--help"}
    text = USAGE.read_text()
    table = [line for line in text[text.index("## Flags"):text.index("## Planning KV memory")]
             .splitlines() if line.startswith("| `-")]
    documented: set[str] = set()
    for line in table:
        cell = line.split(" | ")[0]
        documented |= set(re.findall(r"(--[a-z][\w-]*)", cell))
        documented |= {"--kv-cache-quant" + s for s in re.findall(r"`(-[a-z][\w-]*)", cell)}
        for flag, choices in re.findall(r"`(--[\w-]+) \{([^}]+)\}", cell):
            assert flags[flag].choices is not None, flag
            assert choices.split(",") == [str(c) for c in flags[flag].choices], flag
    assert sorted(set(flags) - documented) == []
    assert sorted(documented - set(flags)) == []
