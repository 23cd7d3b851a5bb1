"""What CI runs is the README's test command and nothing less: `.ci/run` is `make test`,
`make test` is tools/test.sh, which makes every environment and runs ruff, the layer check and
all three suites, each suite with its slowest tests printed; `slow` gates exactly the longer
runs tests/README.md lists under `make test-long`."""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _commands(path: Path) -> list[list[str]]:
    """The shell commands of a script, ``\\``-continued lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    return [argv for line in text.splitlines() if (argv := shlex.split(line, comments=True))]


def test_ci_runs_make_test_and_make_test_runs_tools_test_sh() -> None:
    assert _commands(ROOT / ".ci" / "run")[-1] == ["make", "test"]
    recipe = re.search(r"^test:\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert recipe and "bash tools/test.sh" in recipe.group(1)


def test_tools_test_sh_runs_every_environment_check_and_suite() -> None:
    phases = {}
    commands = _commands(ROOT / "tools" / "test.sh")
    for argv in commands:
        if argv[0] == "phase":
            argv = [a for a in argv if a != "--go-on"]
            phases[argv[1]] = argv[2:]
    # the vLLM-Omni suite's phase runs in a background subshell, waited for before the end
    at = next(i for i, argv in enumerate(commands) if argv[:1] == ["phase"] and "vllm-omni suite" in argv)
    assert commands[at - 1] == ["("] and commands[at + 2][0] == ")" and commands[at + 2][-1] == "&"
    assert ["wait", "$vo_pid"] in commands[at + 2:]
    assert list(phases) == ["env main", "env sglang", "env vllm-omni", "ruff", "layers",
                            "vllm-omni suite", "main suite", "sglang suite"]
    for name, env in (("main", ".venv"), ("sglang", ".venv-sglang"),
                      ("vllm-omni", ".venv-vllm-omni")):
        assert phases[f"env {name}"][1:] == ["tools/env.py", name, env]
    assert phases["ruff"][-5:] == ["causalkv", "tests", "benchmarks", "demo", "tools"]
    assert phases["layers"] == [".venv/bin/lint-imports"]
    suites = {"main suite": ".venv/bin/python", "sglang suite": ".venv-sglang/bin/python",
              "vllm-omni suite": ".venv-vllm-omni/bin/python"}
    for name, python in suites.items():
        argv = phases[name]
        assert python in argv and '--durations=$DURATIONS' in argv, (name, argv)
        assert "not slow" in argv and argv[argv.index("not slow") - 1] == "-m", (name, argv)
    assert "tests/sglang_bridge/run.py" in phases["sglang suite"]
    assert "tests/vllm_omni_bridge/run.py" in phases["vllm-omni suite"]


def _slow_tests() -> set[str]:
    """``file::test`` of every test marked ``slow`` (a decorator or a module's pytestmark)."""
    found = set()
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        rel = path.relative_to(ROOT).as_posix()
        slow_module = any(isinstance(n, ast.Assign) and "pytestmark" in ast.unparse(n.targets[0])
                          and "slow" in ast.unparse(n.value) for n in tree.body)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and (
                    slow_module or any("mark.slow" in ast.unparse(d) for d in node.decorator_list)):
                found.add(f"{rel}::{node.name}")
    return found


def test_slow_gates_exactly_what_tests_readme_lists_for_make_test_long() -> None:
    text = (ROOT / "tests" / "README.md").read_text()
    section = text[text.index("## `make test-long`"):]
    section = section[:section.index("\n## ", 1)] if "\n## " in section[1:] else section
    listed = set(re.findall(r"`(tests/[\w/]+\.py::\w+)`", section))
    assert listed and listed == _slow_tests()
