"""The README's command blocks show what the Makefile runs: every ``make X`` line names a
Makefile target, and every ``causalkv ...`` command is, flag for flag, one of the Makefile's
recipe commands (``$(BIN)/causalkv`` there), so running the README's block verbatim does what
``make run`` does (its video and metrics file included). And the demos the README names run
nothing from tests/."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S)


def commands(block: str) -> list[list[str]]:
    """The block's commands, ``\\``-continued lines joined, comments dropped, as argv lists."""
    joined = re.sub(r"\\\n", " ", block)
    return [shlex.split(line, comments=True) for line in joined.splitlines()
            if shlex.split(line, comments=True)]


def makefile_recipes(text: str) -> dict[str, list[list[str]]]:
    """Each target's recipe commands (argv lists, ``$(BIN)/`` and ``$(CURDIR)/`` dropped)."""
    recipes: dict[str, list[list[str]]] = {}
    target = None
    joined = re.sub(r"\\\n", " ", text)
    for line in joined.splitlines():
        head = re.match(r"^([A-Za-z0-9_.$()/-]+):", line)
        if head and not line.startswith("\t"):
            target = head.group(1)
            recipes.setdefault(target, [])
        elif line.startswith("\t") and target is not None and not line.strip().startswith("#"):
            argv = shlex.split(line.replace("$(BIN)/", "").replace("$(CURDIR)/", ""))
            recipes[target].append(argv)
    return recipes


README = (ROOT / "README.md").read_text()
RECIPES = makefile_recipes((ROOT / "Makefile").read_text())


def test_the_readme_has_the_blocks_this_test_reads() -> None:
    blocks = [commands(b) for b in bash_blocks(README)]
    assert any(argv[:2] == ["make", "run"] for cmds in blocks for argv in cmds)
    assert any(argv[:2] == ["causalkv", "generate"] for cmds in blocks for argv in cmds)
    assert RECIPES["run"] and RECIPES["run-sglang"] and RECIPES["test"]


def test_every_make_line_of_the_readme_is_a_makefile_target() -> None:
    for block in bash_blocks(README):
        for argv in commands(block):
            if argv[0] == "make":
                assert len(argv) == 2 and argv[1] in RECIPES, argv


def test_every_causalkv_command_of_the_readme_is_a_makefile_recipe_verbatim() -> None:
    recipe_commands = [argv for cmds in RECIPES.values() for argv in cmds]
    shown = [argv for block in bash_blocks(README) for argv in commands(block)
             if argv[0] == "causalkv"]
    assert shown
    for argv in shown:
        assert argv in recipe_commands, shlex.join(argv)


def test_make_run_is_the_command_the_readme_says_it_runs() -> None:
    (run,) = RECIPES["run"]
    shown = [argv for block in bash_blocks(README) for argv in commands(block)
             if argv[:2] == ["causalkv", "generate"]]
    assert run in shown
    # what the text around it promises: the video and the metrics file under out/
    assert "--metrics" in run and "--output" in run
    assert run[run.index("--metrics") + 1] == "out/tiny-longlive2-1k-metrics.json"
    assert run[run.index("--output") + 1] == "out/tiny-longlive2-1k.mp4"
    assert "`out/tiny-longlive2-1k.mp4` and `out/tiny-longlive2-1k-metrics.json`" in README


def test_the_demos_run_nothing_from_tests_and_the_package_never_loads_the_cpu_stand_ins() -> None:
    """``make run`` and ``make run-sglang`` are the product's demos: no test file on their
    path. The CPU stand-ins for sglang's kernels (``demo/sglang/cpu_stand_ins``) live outside
    the package, which never names them."""
    for target in ("run", "run-sglang"):
        for argv in RECIPES[target]:
            assert not any("tests/" in arg for arg in argv), (target, argv)
    (sglang_run,) = RECIPES["run-sglang"]
    assert "PYTHONPATH=demo/sglang/cpu_stand_ins" in sglang_run
    stand_ins = ROOT / "demo" / "sglang" / "cpu_stand_ins"
    assert {p.name for p in stand_ins.glob("*.py")} == {"sitecustomize.py", "cpu_kernels.py", "tvshim.py"}
    for path in (ROOT / "demo").rglob("*.py"):
        imports = re.findall(r"^\s*(?:from|import)\s+([\w.]+)", path.read_text(), re.M)
        assert not any(name.split(".")[0] in {"tests", "e2e", "realtime_probe"} for name in imports), path
    for path in (ROOT / "causalkv").rglob("*.py"):
        text = path.read_text()
        assert "tvshim" not in text and "cpu_kernels" not in text and "cpu_stand_ins" not in text, path
