"""Every ```python block of README.md and docs/*.md runs in the suite, as a reader would run it:
a page's blocks in order, in one namespace, each one a test (id ``page:line``, the line of its
opening fence). The conventions a block may use (tests/README.md, "The docs' Python blocks"):

- ```` ```python fragment ````: deliberately not runnable; counted, not run (keep these rare).
- A first line ``# some/path.py`` makes the block that file of a plugin the page builds: it is
  written under a temporary folder on ``sys.path`` and imported (it runs as that module, and
  later blocks import it); ``# some/path.py (continued)`` appends to the file the page started
  and imports it again.
- Every ``test_*`` function a block defines is called right after the block, as pytest would.

The pages run in one subprocess (``python tests/test_docs_blocks.py RESULTS_DIR
[--preload=torch] PAGE...``) that imports torch once and forks a child per page: nothing a
block registers (plugins, codecs, records), sets (``os.environ``) or imports leaks into another
page or into the tests this worker runs next. The child runs in an empty temporary folder with
``tests/`` on ``sys.path`` (as pytest puts it there), an empty ``CAUSALKV_HOME`` of its own and
no other ``CAUSALKV_*`` variable, torch on one thread (``OMP_NUM_THREADS=1``), and hypothesis
under the ``dev`` profile (`oracle.examples` gives a tenth). Only torch is preloaded: a page
may still set ``TRITON_INTERPRET`` before triton loads (docs/attention.md does).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
import types
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: any fence a reader takes for Python (```python, ```py, ```python3), with its info string
FENCE = re.compile(r"^```(?:python3?|py)\b([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)
OPENING = re.compile(r"^```(?:python3?|py)\b", re.M)
#: a block that is a file of the page's plugin: ``# my_plugin/world.py`` [``(continued)``]
FILE_LINE = re.compile(r"# ((?:[A-Za-z_]\w*/)*[A-Za-z_]\w*\.py)( \(continued\))?[ \t]*\n")
#: the runnable blocks the docs hold now; fewer means a block was lost or made a fragment
MIN_RUNNABLE = 26
#: one page's run, all its blocks (a block should take a few seconds at most)
PAGE_TIMEOUT_S = 300


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    source: str
    fragment: bool

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def file(self) -> tuple[str, bool] | None:
        """``(path, continued)`` of a plugin-file block, else None."""
        m = FILE_LINE.match(self.source)
        return (m.group(1), bool(m.group(2))) if m else None


def page_blocks(text: str, page: str) -> list[Block]:
    return [Block(page, text.count("\n", 0, m.start()) + 1, m.group(2),
                  "fragment" in m.group(1).split())
            for m in FENCE.finditer(text)]


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


ALL = [b for path in PAGES for b in page_blocks(path.read_text(), _rel(path))]
RUNNABLE = [b for b in ALL if not b.fragment]
FRAGMENTS = [b for b in ALL if b.fragment]


# ---- the page runner (the subprocess) -------------------------------------------------------------
def _new_tests(before: dict, after: dict) -> list:
    return [f for name, f in after.items()
            if name.startswith("test_") and isinstance(f, types.FunctionType)
            and before.get(name) is not f]


def _run_block(block: Block, namespace: dict, modules: Path) -> None:
    file = block.file
    if file is None:
        before = dict(namespace)
        exec(compile(block.source, block.id, "exec"), namespace)
        tests = _new_tests(before, namespace)
    else:
        rel, continued = file
        path = modules / rel
        if continued:
            assert path.exists(), f"{rel} (continued): no earlier block of the page starts {rel}"
            path.write_text(path.read_text() + "\n\n" + block.source)
        else:
            assert not path.exists(), f"a second block starts {rel}; say '# {rel} (continued)'"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(block.source)
        name = rel[: -len(".py")].replace("/", ".")
        sys.modules.pop(name, None)  # a continued file is imported again, whole
        importlib.invalidate_caches()
        module = importlib.import_module(name)
        tests = _new_tests({}, {k: v for k, v in vars(module).items()
                                if getattr(v, "__module__", None) == name})
    for test in tests:
        test()


def run_page(page: Path, results: Path) -> None:
    """Run ``page``'s runnable blocks in order in one namespace; append one JSON line per
    block to ``results`` (``line``, ``ok``, ``error``, ``seconds``)."""
    modules = Path(tempfile.mkdtemp(prefix="docs-blocks-modules-"))
    sys.path.insert(0, str(modules))
    namespace: dict = {"__name__": "__main__"}
    failed: str | None = None
    for block in page_blocks(page.read_text(), page.name):
        if block.fragment:
            continue
        start = time.perf_counter()
        if failed is not None:
            ok, error = False, f"not run: {failed}, before it in the page, failed"
        else:
            try:
                _run_block(block, namespace, modules)
                ok, error = True, ""
            except BaseException:  # every failure is the block's result
                ok, error = False, traceback.format_exc(limit=-12)
                failed = block.id
        with results.open("a") as f:
            f.write(json.dumps({"line": block.line, "ok": ok, "error": error,
                                "seconds": round(time.perf_counter() - start, 3)}) + "\n")


def run_pages(results: Path, pages: list[Path], preload: list[str]) -> int:
    """Import ``preload`` once (torch: seconds), then run each page in a forked child of its
    own: whatever a page's blocks change dies with its child. Results: ``results/<i>.jsonl``."""
    from hypothesis import HealthCheck, settings

    settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("dev")
    sys.dont_write_bytecode = True  # a continued file is rewritten within the same second
    for name in preload:
        importlib.import_module(name)
    for i, page in enumerate(pages):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: run the page, leave without the parent's exit handlers
            code = 0
            try:
                run_page(page, results / f"{i}.jsonl")
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        os.waitpid(pid, 0)
    return 0


# ---- the tests ------------------------------------------------------------------------------------
def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAUSALKV_")}
    env.update(CAUSALKV_HOME=str(home), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])]))
    return env


def run_in_subprocess(pages: list[Path], preload: tuple[str, ...] = ("torch",)
                      ) -> tuple[list[dict[int, dict]], str]:
    """Per page, ``{line: result}`` of its blocks; and the tail of the subprocess' output."""
    with tempfile.TemporaryDirectory(prefix="docs-blocks-") as tmp:
        for sub in ("home", "cwd", "results"):
            (Path(tmp) / sub).mkdir()
        argv = [sys.executable, str(Path(__file__).resolve()), str(Path(tmp) / "results")]
        argv += [f"--preload={name}" for name in preload] + [str(p) for p in pages]
        proc = subprocess.run(argv, cwd=Path(tmp) / "cwd", env=_env(Path(tmp) / "home"),
                              capture_output=True, text=True, timeout=PAGE_TIMEOUT_S * len(pages))
        found = []
        for i in range(len(pages)):
            path = Path(tmp) / "results" / f"{i}.jsonl"
            lines = path.read_text().splitlines() if path.exists() else []
            found.append({r["line"]: r for r in map(json.loads, lines)})
    tail = f"exit {proc.returncode}; output:\n{(proc.stdout + proc.stderr)[-3000:]}"
    return found, tail


@cache
def all_results() -> tuple[dict[str, dict[int, dict]], str]:
    """Every page with a runnable block, run once (by whichever test asks first)."""
    pages = sorted({b.page for b in RUNNABLE})
    found, tail = run_in_subprocess([ROOT / page for page in pages])
    return dict(zip(pages, found)), tail


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_block_runs(block: Block) -> None:
    by_page, tail = all_results()
    results = by_page[block.page]
    assert block.line in results, f"{block.id}: the page's run ended before this block ({tail})"
    assert results[block.line]["ok"], f"{block.id} failed:\n{results[block.line]['error']}"


def test_every_python_block_is_found_and_run_or_a_fragment() -> None:
    for path in PAGES:
        text = path.read_text()
        assert len(page_blocks(text, _rel(path))) == len(OPENING.findall(text)), (
            f"{_rel(path)}: a python fence without its closing ```")
    assert len(ALL) == len(RUNNABLE) + len(FRAGMENTS)
    assert len(RUNNABLE) >= MIN_RUNNABLE, [b.id for b in RUNNABLE]
    assert len(FRAGMENTS) <= 2, f"fragments are rare: make {[b.id for b in FRAGMENTS]} run"


def test_every_runnable_block_ran() -> None:
    """The reports cover every runnable block, ok (the pages' runs, shared with the tests
    above in this worker); the counts are printed (``-s``)."""
    by_page, _ = all_results()
    ran = sum(len(results) for results in by_page.values())
    ok = sum(r["ok"] for results in by_page.values() for r in results.values())
    print(f"docs python blocks: {len(ALL)} found, {ran} ran ({ok} ok), {len(FRAGMENTS)} fragments")
    assert ran == ok == len(RUNNABLE)


def test_the_runner_reports_a_failure_and_what_it_stopped(tmp_path: Path) -> None:
    """A failing block fails, the blocks after it are reported as not run, a fragment is not
    run, a plugin-file block is importable by the next one, a test a block defines is called,
    and a block's environment does not reach the test process."""
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nimport os\nos.environ['CAUSALKV_DOCS_BLOCK_LEAK'] = '1'\nx = 1\n```\n"
        "```python fragment\nthis is not python\n```\n"
        "```python\n# pkg_docs_probe/mod.py\nVALUE = 2\n```\n"
        "```python\n# pkg_docs_probe/mod.py (continued)\nOTHER = VALUE + 1\n```\n"
        "```python\nfrom pkg_docs_probe.mod import OTHER\nassert x + OTHER == 4\n"
        "def test_called():\n    raise ValueError('the block test was called')\n```\n"
        "```python\ny = 2\n```\n"
    )
    (results,), tail = run_in_subprocess([page], preload=())
    assert [(line, r["ok"]) for line, r in sorted(results.items())] == [
        (1, True), (9, True), (13, True), (17, False), (23, False)], tail
    assert "the block test was called" in results[17]["error"]
    assert results[23]["error"] == "not run: page.md:17, before it in the page, failed"
    assert "CAUSALKV_DOCS_BLOCK_LEAK" not in os.environ
    blocks = page_blocks(page.read_text(), "page.md")
    assert [b.fragment for b in blocks] == [False, True, False, False, False, False]
    assert [b.file for b in blocks][2:4] == [("pkg_docs_probe/mod.py", False),
                                              ("pkg_docs_probe/mod.py", True)]


if __name__ == "__main__":
    _args = sys.argv[2:]
    sys.exit(run_pages(Path(sys.argv[1]), [Path(a) for a in _args if not a.startswith("--")],
                       [a.split("=", 1)[1] for a in _args if a.startswith("--preload=")]))
