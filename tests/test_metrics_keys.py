"""The metrics docs/usage.md lists are the metrics the command writes, both ways.

Three runs cover every key: LongLive 2.0 (two shots, int2, ``--compare-bf16``, a video and
saved latents), LingBot-World with a motion signal, LongLive with a prompt switch. Every key
the "Metrics" table of docs/usage.md names must be in one of their metrics files, and every
key of those files must be in the table.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fault_helpers import run_cli

ROOT = Path(__file__).resolve().parents[1]


def documented_keys() -> set[str]:
    """The keys in the first cell of every row of the "Metrics" table of docs/usage.md."""
    text = (ROOT / "docs" / "usage.md").read_text()
    section = text[text.index("## Metrics\n") : text.index("## What each stage expects")]
    keys: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            keys.update(re.findall(r"`([a-z0-9_]+)`", line.split(" | ")[0]))
    return keys


RUNS = {
    "longlive2": ["--model", "tiny-longlive2", "--prompt", "a forest", "--prompt", "a city",
                  "--frames", "4", "--kv-cache-quant", "int2", "--compare-bf16",
                  "--output", "{tmp}/v.gif", "--save-latents", "{tmp}/l.safetensors"],
    "lingbot": ["--model", "tiny-lingbot", "--frames", "6", "--motion", "m,s", "--no-video"],
    "longlive": ["--model", "tiny-longlive", "--frames", "6", "--prompt", "a", "--prompt", "b",
                 "--no-video"],
}


@pytest.fixture(scope="module")
def emitted(causalkv_home: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    tmp = tmp_path_factory.mktemp("metrics")
    out: dict[str, set[str]] = {}
    for name, argv in RUNS.items():
        metrics = tmp / f"{name}.json"
        argv = [a.format(tmp=tmp) for a in argv]
        rc = run_cli(["generate", "--quiet", "--dtype", "float32", "--metrics", str(metrics), *argv])
        assert rc == 0, name
        out[name] = set(json.loads(metrics.read_text()))
    return out


def test_the_table_lists_keys() -> None:
    keys = documented_keys()
    assert {"kv_resident_bytes_max", "latent_psnr_db", "pinned_chunks", "kv_window_per_chunk"} <= keys
    assert "cache_bytes" not in keys  # no code writes it


def test_every_documented_key_is_written(emitted: dict[str, set[str]]) -> None:
    written = set().union(*emitted.values())
    assert sorted(documented_keys() - written) == []


def test_every_written_key_is_documented(emitted: dict[str, set[str]]) -> None:
    undocumented = {name: sorted(keys - documented_keys()) for name, keys in emitted.items()}
    assert undocumented == {name: [] for name in emitted}
