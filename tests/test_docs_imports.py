"""Every ``from causalkv... import ...`` line in the README and docs/ works as written."""

from __future__ import annotations

import importlib.util
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

#: bridge modules that import their host: where the host is not installed (this suite's
#: environment) such a line must fail for that reason alone; each host's own suite
#: (tests/sglang_bridge, tests/vllm_omni_bridge) runs them with the host installed
HOST_OF = {"causalkv.sglang.": "sglang", "causalkv.vllm_omni.": "vllm_omni"}


def host_of(statement: str) -> str | None:
    """The host package a docs import line needs (None: causalkv's own dependencies)."""
    module = statement.split()[1] + "."
    return next((host for prefix, host in HOST_OF.items() if module.startswith(prefix)), None)


def test_the_docs_import_something() -> None:
    assert len(IMPORTS) >= 5, IMPORTS


@pytest.mark.parametrize(("doc", "statement"), IMPORTS, ids=[f"{d}:{s}" for d, s in IMPORTS])
def test_doc_import_works(doc: str, statement: str) -> None:
    host = host_of(statement)
    if host is not None and importlib.util.find_spec(host) is None:
        with pytest.raises(ModuleNotFoundError) as missing:
            exec(compile(statement, doc, "exec"), {})
        assert missing.value.name.split(".")[0] == host, missing.value
        return
    exec(compile(statement, doc, "exec"), {})
