"""Every docs import line of a bridge module that imports sglang works here, where sglang is
installed (the main suite checks that, without sglang, such a line fails for that reason alone)."""

from __future__ import annotations

import pytest
from test_docs_imports import IMPORTS, host_of

MINE = [(doc, stmt) for doc, stmt in IMPORTS if host_of(stmt) == "sglang"]


@pytest.mark.parametrize(("doc", "statement"), MINE, ids=[f"{d}:{s}" for d, s in MINE])
def test_doc_import_works_with_sglang(doc: str, statement: str) -> None:
    exec(compile(statement, doc, "exec"), {})
