"""Every ``from causalkv... import ...`` line in the README and docs/ works as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PATTERN = re.compile(r"^\s*(from causalkv[\w.]* import [^\n#]+?|import causalkv[\w.]*)\s*$", re.M)


def _imports() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in PATTERN.finditer(text):
            stmt = m.group(1).strip()
            if stmt.endswith("("):  # a parenthesized multi-line import: read to the ")"
                end = text.index(")", m.end())
                stmt = stmt + text[m.end() : end + 1]
            found.append((doc.name, " ".join(stmt.replace("\\\n", " ").split())))
    return found


IMPORTS = _imports()


def test_the_docs_import_something() -> None:
    assert len(IMPORTS) >= 5, IMPORTS


@pytest.mark.parametrize(("doc", "statement"), IMPORTS, ids=[f"{d}:{s}" for d, s in IMPORTS])
def test_doc_import_works(doc: str, statement: str) -> None:
    exec(compile(statement, doc, "exec"), {})
