"""Lines of code by an AST scan: the lines that hold a statement or an expression, leaving out
docstrings, comments and blank lines (a statement spanning lines counts each of its lines).

    .venv/bin/python benchmarks/loc.py causalkv/hooks causalkv/plugin      # per file and the total
    .venv/bin/python benchmarks/loc.py --packages causalkv                  # per package, files over 500 lines
"""

from __future__ import annotations

import argparse
import ast
import signal
import sys
from collections import Counter
from pathlib import Path


def _docstring_lines(tree: ast.AST) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                out.update(range(body[0].lineno, body[0].end_lineno + 1))
    return out


def code_lines(path: Path) -> int:
    """Lines of ``path`` covered by a statement, docstrings left out (comments and blank lines
    are covered by no node unless inside a multi-line statement, where they count as its lines
    only if they hold code tokens: blank and comment-only lines are subtracted)."""
    text = path.read_text()
    tree = ast.parse(text)
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt):
            lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    lines -= _docstring_lines(tree)
    source = text.splitlines()
    return sum(1 for n in lines if source[n - 1].strip() and not source[n - 1].strip().startswith("#"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", type=Path)
    p.add_argument("--packages", action="store_true", help="total per package; list files over 500 lines")
    a = p.parse_args(argv)
    missing = [str(path) for path in a.paths if not path.exists()]
    if missing:  # else a mistyped path counts as 0 lines
        p.error(f"no such file or folder: {', '.join(missing)} (paths are relative to {Path.cwd()})")
    files = sorted(f for path in a.paths for f in ([path] if path.is_file() else path.rglob("*.py")))
    counts = {f: code_lines(f) for f in files}
    if a.packages:
        per = Counter()
        for f, n in counts.items():
            per[str(f.parent)] += n
        for pkg, n in sorted(per.items()):
            print(f"{n:6d}  {pkg}")
        print("files over 500 lines (physical):")
        for f in files:
            total = len(f.read_text().splitlines())
            if total > 500:
                print(f"{total:6d}  {f}")
    else:
        for f, n in counts.items():
            print(f"{n:6d}  {f}")
    print(f"{sum(counts.values()):6d}  total")
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head`: end quietly, as a pipe's reader left
    sys.exit(main())
