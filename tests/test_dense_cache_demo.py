"""`causalkv demo` prints what the oracle says a LongLive-2.0-like stream sees."""

from __future__ import annotations

import re

import pytest
from oracle import OracleCache, runs_of

from causalkv.caches.demo import FORWARDS_PER_CHUNK, DemoConfig
from causalkv.cli import main

ROW = re.compile(
    r"^\s*(?P<chunk>\d+)\s+\[(?P<a>\d+),(?P<b>\d+)\)\s+(?P<pin>pin)?\s+"
    r"(?P<visible>(?:\[\d+,\d+\) ?)+)\s+(?P<count>\d+)\s+(?P<shot>-|\[\d+,\d+\))\s+"
    r"(?P<size>[\d.]+) (?P<unit>B|KiB|MiB|GiB)$"
)
MAP = re.compile(r"^\s*(?P<chunk>\d+)\s+\|(?P<map>[^|]*)\|$")


def oracle_stream(config: DemoConfig):
    """Per chunk: (visible runs, pinned here, shot sink after, map), from the oracle."""
    spec = config.spec()
    o = OracleCache.from_spec(spec)
    n, tpf = config.chunk_tokens, config.tokens_per_frame
    out = []
    for c in range(config.chunks):
        for step in range(FORWARDS_PER_CHUNK):
            o.write(c * n, n, None, spec.num_heads, None, step + 1)
        visible, seen_pin = o.visible(), o.pinned
        if c in config.cuts:
            o.pin(n)
        chars = []
        for f in range(config.chunks * config.frames_per_chunk):
            p = f * tpf
            if p >= (c + 1) * n:
                chars.append(" ")
            elif p in visible:
                if p < spec.global_sink_tokens:
                    chars.append("G")
                elif seen_pin and seen_pin[0] <= p < seen_pin[1]:
                    chars.append("P")
                elif p >= c * n:  # a cut chunk is pinned after its context pass: P
                    chars.append("P" if c in config.cuts else "C")
                else:
                    chars.append("#")
            else:
                chars.append("r" if p in o.retained else ".")
        out.append((runs_of(visible), c in config.cuts, o.pinned, "".join(chars)))
    return out


def parse(text: str):
    rows = [m.groupdict() for line in text.splitlines() if (m := ROW.match(line))]
    maps = [m["map"] for line in text.splitlines() if (m := MAP.match(line))]
    return rows, maps


def ranges(text: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in re.findall(r"\[(\d+),(\d+)\)", text)]


@pytest.mark.parametrize(
    ("argv", "config"),
    [
        (["demo"], DemoConfig()),
        (["demo", "--chunks", "12", "--tokens-per-frame", "3", "--cuts", "2,3,9"],
         DemoConfig(chunks=12, tokens_per_frame=3, cuts=(2, 3, 9))),
        (["demo", "--chunks", "6", "--cuts", ""], DemoConfig(chunks=6, cuts=())),
    ],
)
def test_demo_prints_the_oracle_stream(argv, config, capsys):
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows, maps = parse(out)
    expected = oracle_stream(config)
    assert len(rows) == len(maps) == config.chunks
    spec = config.spec()
    resident = 2 * spec.batch_size * spec.cache_size * spec.num_heads * spec.head_dim * 2
    for c, (row, frame_map, (visible, pinned_here, shot, want_map)) in enumerate(
        zip(rows, maps, expected)
    ):
        n = config.chunk_tokens
        assert int(row["chunk"]) == c
        assert (int(row["a"]), int(row["b"])) == (c * n, (c + 1) * n)
        assert ranges(row["visible"]) == visible, c
        assert int(row["count"]) == sum(b - a for a, b in visible)
        assert (row["pin"] == "pin") == pinned_here
        assert (ranges(row["shot"]) or [None])[0] == shot
        # binary units, as `causalkv memory` prints them: 2 decimals of KiB/MiB/GiB
        unit = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[row["unit"]]
        assert 1 <= resident / unit < 1024 or row["unit"] == "B"
        assert float(row["size"]) == round(resident / unit, 2)
        assert frame_map == want_map, c
    if config.cuts:
        assert "scene cuts (pinned after their context pass): chunks " + ", ".join(
            map(str, config.cuts)) in out


def test_demo_default_shows_the_shot_sink_release(capsys):
    """Hand-checked (same numbers as the LongLive 2.0 reference test): the first shot sink
    [48, 64) stays visible through chunk 6 and is gone at chunk 7 after the second cut."""
    main(["demo"])
    rows, maps = parse(capsys.readouterr().out)
    assert ranges(rows[6]["visible"]) == [(0, 16), (48, 64), (80, 112)]
    assert ranges(rows[7]["visible"]) == [(0, 16), (80, 128)]
    assert [r["pin"] for r in rows].count("pin") == 2
    assert maps[5] == "G" * 8 + "." * 16 + "P" * 8 + "#" * 8 + "C" * 8 + " " * 24
    # a cut chunk is pinned after its context pass: the map (drawn after it) shows it as P
    assert maps[3] == "G" * 8 + "#" * 16 + "P" * 8 + " " * 40
    assert maps[6][48:56] == "P" * 8 and "C" not in maps[6]


def test_demo_full_scale_line_matches_facts(capsys):
    main(["demo", "--chunks", "1"])
    out = capsys.readouterr().out
    # docs/design.md: LongLive 2.0 (5B) 368,640 B per token; a 32-frame window of 28,160 tokens
    # = 10,380,902,400 B = 9.67 GiB (2^30 B), the dense_bytes `causalkv memory longlive2` prints
    assert "28,160 tokens: 9.67 GiB of K/V (368,640 B per token)" in out
    assert " GB" not in out


@pytest.mark.parametrize("argv", [["demo", "--cuts", "3,x"], ["demo", "--chunks", "0"]])
def test_demo_rejects_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "demo" in capsys.readouterr().err
