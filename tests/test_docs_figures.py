"""The figures the docs quote that a computation gives deterministically are recomputed here,
so a doc that drifts from the code fails a test: the QVG byte formula in docs/design.md, the
centroid-sweep table of docs/packed_cache.md and the claims below it (``benchmarks/cache.py
--centroid-sweep``, seeded), its tiny-preset resident bytes, and the registration tables of
docs/plugins.md and docs/usage.md.

To refresh the sweep table after a codec change: ``python tests/test_docs_figures.py``
prints it (the same `sweep_table` this test compares).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any


ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def doc(name: str) -> str:
    return (DOCS / name).read_text()


# ---- docs/design.md: the byte formula -------------------------------------------------------------
def test_design_quotes_the_int2_bits_the_formula_gives() -> None:
    from causalkv.caches.qvg.format import bits_per_element
    from causalkv.caches.qvg.options import QVGKVQuantArgs

    bits = bits_per_element(4680, 128, QVGKVQuantArgs(codec="int2"))  # the reference's defaults
    text = " ".join(doc("design.md").split())
    assert f"that is {bits:.3f} bits per element: {16 / bits:.1f}x less than bf16" in text
    assert f"about {16 / bits:.0f}x at 2 bits" in text


# ---- docs/packed_cache.md: the centroid sweep --------------------------------------------------------
@lru_cache(maxsize=1)
def sweep() -> dict[tuple[int, int, str], dict[str, Any]]:
    """``benchmarks/cache.py``'s `centroid_sweep`, by (tokens, bits, which)."""
    path = ROOT / "benchmarks" / "cache.py"
    spec = importlib.util.spec_from_file_location("ckv_bench_cache", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return {(r["tokens"], r["bits"], r["which"]): r for r in module.centroid_sweep()}


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


# ---- registrations ---------------------------------------------------------------------------------
def test_plugins_md_lists_every_builtin_stage_with_its_presets() -> None:
    from causalkv.plugin.builtin import STAGES

    text = doc("plugins.md")
    for reg in STAGES:
        target = reg.target if isinstance(reg.target, str) else f"{reg.target.__module__}:{reg.target.__qualname__}"
        row = f"| `{reg.name}` | `{target}` | {', '.join(reg.served)} |"
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
