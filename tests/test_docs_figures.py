"""The figures the docs quote that a computation gives deterministically are recomputed here,
so a doc that drifts from the code fails a test: the QVG byte formula in docs/design.md, the
centroid-sweep table of docs/packed_cache.md and the claims below it (``benchmarks/cache.py
--centroid-sweep``, seeded), its tiny-preset resident bytes and centroid rule, the quality
table of docs/qvg.md (``benchmarks/codec.py``, seeded; the rows that need no peer package),
docs/design.md's layout and layers against the package and pyproject's import contract, and
the registration tables of docs/plugins.md and docs/usage.md. The figures quoted from
``causalkv memory`` and ``causalkv generate`` are checked in tests/test_doc_commands.py.

To refresh the sweep table after a codec change: ``python tests/test_docs_figures.py``
prints it (the same `sweep_table` this test compares).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def doc(name: str) -> str:
    return (DOCS / name).read_text()


# ---- docs/design.md: the byte formula -------------------------------------------------------------
def test_design_quotes_the_int2_bits_the_formula_gives() -> None:
    from causalkv.caches.codecs.prq.format import bits_per_element
    from causalkv.caches.qvg.options import QVGKVQuantArgs

    bits = bits_per_element(4680, 128, QVGKVQuantArgs(codec="int2"))  # the reference's defaults
    text = " ".join(doc("design.md").split())
    assert f"that is {bits:.3f} bits per element: {16 / bits:.1f}x less than bf16" in text
    assert f"about {16 / bits:.0f}x at 2 bits" in text


# ---- docs/packed_cache.md: the centroid sweep --------------------------------------------------------
@cache
def bench(name: str) -> Any:
    """The script ``benchmarks/<name>.py`` as a module (its functions compute the figures)."""
    spec = importlib.util.spec_from_file_location(f"ckv_bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@lru_cache(maxsize=1)
def sweep() -> dict[tuple[int, int, str], dict[str, Any]]:
    """``benchmarks/cache.py``'s `centroid_sweep`, by (tokens, bits, which)."""
    return {(r["tokens"], r["bits"], r["which"]): r for r in bench("cache").centroid_sweep()}


def _cell(r: dict[str, Any], *, show_k: bool) -> str:
    head = f"K={r['centroids']}: " if show_k else ""
    return f"{head}{r['bits_per_element']:.2f} b, {r['k_rel_err']:.3f} / {r['v_rel_err']:.3f}"


def sweep_table() -> list[str]:
    """The markdown rows of the sweep table (header included)."""
    s = sweep()
    rows = ["| tokens | int2, fixed 128 (capped at S) | int2, rule | int4, rule | int4, rule x 2 |",
            "|---|---|---|---|---|"]
    for tokens in sorted({t for t, _, _ in s}):
        fixed, rule2 = s[tokens, 2, "fixed 128"], s[tokens, 2, "rule"]
        same = fixed["centroids"] == rule2["centroids"]
        cells = [
            _cell(fixed, show_k=fixed["centroids"] != 128),
            f"K={rule2['centroids']}: the same" if same else _cell(rule2, show_k=True),
            _cell(s[tokens, 4, "rule"], show_k=True),
            _cell(s[tokens, 4, "rule*2"], show_k=True),
        ]
        rows.append(f"| {tokens:,} | " + " | ".join(cells) + " |")
    return rows


def test_packed_cache_sweep_table_is_the_benchmark_output() -> None:
    text = doc("packed_cache.md").splitlines()
    start = text.index(sweep_table()[0])
    assert text[start : start + len(sweep_table())] == sweep_table()


def test_packed_cache_sweep_claims_hold() -> None:
    s = sweep()
    sizes = sorted({t for t, _, _ in s})
    bits = {k: r["bits_per_element"] for k, r in s.items()}
    # "A fixed 128 makes int2 cost more than bf16 below 128 tokens and more than int4 with
    # the rule up to 880 tokens"
    assert all(bits[t, 2, "fixed 128"] > 16 for t in sizes if t < 128)
    assert all(bits[t, 2, "fixed 128"] > bits[t, 4, "rule"] for t in sizes if t <= 880)
    # "at 480 and 880 tokens int4 with the rule has lower K and V error at fewer bits; below
    # 480 the fixed 128 buys its lower error with three to four times the bits"
    for t in (480, 880):
        f, d = s[t, 2, "fixed 128"], s[t, 4, "rule"]
        assert d["bits_per_element"] < f["bits_per_element"]
        assert d["k_rel_err"] < f["k_rel_err"] and d["v_rel_err"] < f["v_rel_err"]
    for t in (x for x in sizes if x < 480):
        assert 2.5 <= bits[t, 2, "fixed 128"] / bits[t, 4, "rule"] <= 4.5
    # "With the rule int2 costs 2.4-2.7 and int4 4.4-4.7 bits per element, and int4 has the
    # lower error at every size"
    assert all(2.4 <= bits[t, 2, "rule"] <= 2.7 and 4.4 <= bits[t, 4, "rule"] <= 4.7 for t in sizes)
    assert all(s[t, 4, "rule"]["k_rel_err"] < s[t, 2, "rule"]["k_rel_err"] for t in sizes)
    # "Doubling K past the rule costs 0.25-0.45 bit for a 5-35% lower int2 K error"
    for t in sizes:
        extra = bits[t, 2, "rule*2"] - bits[t, 2, "rule"]
        gain = 1 - s[t, 2, "rule*2"]["k_rel_err"] / s[t, 2, "rule"]["k_rel_err"]
        assert 0.25 <= extra <= 0.45 and 0.05 <= gain <= 0.35, (t, extra, gain)


def test_packed_cache_quotes_the_tiny_preset_bytes() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from test_packed_cache import PRESET_GEOMETRIES, _preset_stream

    from causalkv.caches.dense import DenseCausalKVCache
    from causalkv.caches.qvg.options import QVGKVQuantArgs
    from causalkv.caches.qvg.packed import QVGPackedCausalKVCache

    text = " ".join(doc("packed_cache.md").split())
    for name in PRESET_GEOMETRIES:
        peaks = [
            _preset_stream(name, make)[0]
            for make in (DenseCausalKVCache,
                         lambda sp: QVGPackedCausalKVCache(sp, QVGKVQuantArgs(codec="int4")),
                         lambda sp: QVGPackedCausalKVCache(sp, QVGKVQuantArgs(codec="int2")))
        ]
        assert f"{name} {peaks[0]:,} / {peaks[1]:,} / {peaks[2]:,}" in text, (name, peaks)


def test_packed_cache_quotes_the_centroid_rule() -> None:
    """"Chunks of 4,096 tokens and more keep the reference's 128 (LingBot-World's 4,680,
    LongLive 2.0's 7,040); 880 tokens get 16, the tiny presets' 32-48 tokens get 1", and the
    reference's 128 centroids cost 0.44 bit on 4,680-token chunks."""
    from causalkv.caches.codecs.prq.centroids import centroids_for

    text = " ".join(doc("packed_cache.md").split())
    assert ("Chunks of 4,096 tokens and more keep the reference's 128 (LingBot-World's 4,680, "
            "LongLive 2.0's 7,040); 880 tokens get 16, the tiny presets' 32-48 tokens get 1") in text
    assert [centroids_for(s, 128) for s in (4_096, 4_680, 7_040, 880, 32, 48)] == [128] * 3 + [16, 1, 1]
    assert centroids_for(4_095, 128) < 128
    assert f"its own 4,680-token chunks ({16 * 128 / 4_680:.2f})" in text


# ---- docs/qvg.md: the quality table of benchmarks/codec.py -----------------------------------------
#: the table's method labels -> benchmarks/codec.py's method names
QUALITY_LABELS = {
    "RTN min/max, block 64": "rtn-asym",
    "KIVI-style": "kivi",
    "PRQ reference defaults": "prq-ref",
    "PRQ mse4": "prq-mse4",
    "PRQ 64 centroids, mse4": "prq-k64-mse4",
    "PRQ block 128, 96 centroids, mse4": "prq-b128-k96-mse4",
    "PRQ block 128, 64 centroids, mse4": "prq-b128-k64-mse4",
    "PRQ block 128, 32 centroids, mse4": "prq-b128-k32-mse4",
}
#: the peers' rows need the bench extra (hqq, torchao, optimum-quanto), not the test environment
QUALITY_PEERS = {"HQQ", "torchao affine", "quanto", "HQQ / torchao / quanto"}


def quality_rows() -> list[list[str]]:
    """The cells of qvg.md's quality table (bold marks dropped)."""
    text = doc("qvg.md")
    head = "| data | bits | method | bits/el counted | stored | K rel err | V rel err |"
    lines = text[text.index(head):].split("\n\n", 1)[0].splitlines()[2:]
    return [[c.strip().strip("*") for c in line.strip("|").split("|")] for line in lines]


def test_qvg_md_quality_table_is_the_benchmark_output() -> None:
    """Every row of the table that needs no peer package is ``benchmarks/codec.py``'s output
    (`quality` on `quality_data`, seeded): bits counted and stored, K and V error as printed.
    The gaussian PRQ rows give K of two settings and "V within 0.002 of K"."""
    import torch

    rows = quality_rows()
    assert len(rows) == 22
    structured = [r for r in rows if r[0] == "structured" and r[2] not in QUALITY_PEERS]
    gaussian = [r for r in rows if r[0] == "gaussian" and r[2] not in QUALITY_PEERS]
    assert len(structured) == 12 and len(gaussian) == 2
    assert all(r[2] in QUALITY_LABELS or r[2] in QUALITY_PEERS for r in rows if r[0] == "structured")
    codec = bench("codec")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        data = codec.quality_data(quick=False)
        got = codec.quality({"structured": data["structured"]}, {}, methods=set(QUALITY_LABELS.values()))
        got += codec.quality({"gaussian": data["gaussian"]}, {},
                             methods={"prq-mse4", "prq-b128-k96-mse4", "prq-k64-mse4"})
    finally:
        torch.set_num_threads(threads)
    by = {(r["data"], r["bits"], r["method"], r["tensor"]): r for r in got}
    for _, bits, label, counted, stored, k_err, v_err in structured:
        k, v = (by["structured", int(bits), QUALITY_LABELS[label], t] for t in "KV")
        assert [counted, stored, k_err, v_err] == [
            f"{k['bits_per_element']:.3f}", f"{k['bits_stored']:.3f}",
            f"{k['rel_err']:.4f}", f"{v['rel_err']:.4f}"], (bits, label)
    for _, bits, label, counted, _, k_err, v_err in gaussian:
        first, second = label.split(" / ")
        assert v_err == "within 0.002 of K"
        for name, count, err in zip((first, "PRQ " + second), counted.split(" / "), k_err.split(" / ")):
            k, v = (by["gaussian", int(bits), QUALITY_LABELS[name], t] for t in "KV")
            assert (count, err) == (f"{k['bits_per_element']:.3f}", f"{k['rel_err']:.3f}"), (bits, name)
            assert abs(v["rel_err"] - k["rel_err"]) <= 0.002, (bits, name)


# ---- docs/design.md: the layout and the layers --------------------------------------------------------
def test_design_md_layers_are_the_import_contract() -> None:
    """The layers line is pyproject's layers contract, and the layout names every package and
    top-level module of causalkv."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c["layers"] for c in contracts if c["type"] == "layers" and "containers" not in c)
    line = " -> ".join(layer.replace("causalkv.", "") for layer in layers)
    text = doc("design.md")
    assert f"```text\n{line}\n```" in text, line
    layout = text[text.index("## Layout"):text.index("### Layers")]
    shown = set(re.findall(r"^  ([\w.]+/?)\s", layout, re.M))
    package = ROOT / "causalkv"
    wanted = {f"{p.name}/" for p in package.iterdir() if (p / "__init__.py").exists()}
    wanted |= {p.name for p in package.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    assert sorted(wanted - shown) == [] and sorted(shown - wanted) == []


# ---- registrations ---------------------------------------------------------------------------------
def test_plugins_md_lists_every_builtin_stage_with_its_presets() -> None:
    from causalkv.plugin.builtin import STAGES

    text = doc("plugins.md")
    for reg in STAGES:
        target = reg.target if isinstance(reg.target, str) else f"{reg.target.__module__}:{reg.target.__qualname__}"
        row = f"| `{reg.name}` | `{target}` | {', '.join(reg.served)} |"
        assert row in text, row


def test_plugins_md_lists_every_builtin_host_class() -> None:
    from causalkv.plugin.builtin import HOSTS

    text = doc("plugins.md")
    for reg in HOSTS:
        row = f"| `{reg.host}` | `{reg.target}` | {', '.join(reg.models)} |"
        assert row in text, row


def test_usage_md_lists_every_preset_once_and_each_metrics_key_once() -> None:
    from causalkv.plugin.builtin import STAGES

    text = doc("usage.md")
    table = [line for line in text.splitlines() if re.match(r"\| `tiny-[\w-]+`", line)]
    names = [re.match(r"\| `([\w-]+)`", line).group(1) for line in table]  # type: ignore[union-attr]
    assert sorted(names) == sorted(p.name for reg in STAGES for p in reg.presets)
    metrics = text[text.index("## Metrics") : text.index("## What each stage expects")]
    bullets = [line for line in metrics.splitlines() if line.startswith("- ")]
    assert len(bullets) == len(set(bullets))
    keys = re.findall(r"`(\w+)`", metrics)
    top = [k for k in keys if k in {"chunk_prompts", "pinned_chunks", "latent_psnr_db", "video_frames"}]
    assert sorted(top) == sorted(set(top)), "a metrics key is described twice"
    assert "the main job (`make run`)" not in text


if __name__ == "__main__":
    print("\n".join(sweep_table()))
