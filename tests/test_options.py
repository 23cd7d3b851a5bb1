"""`causalkv.options`: a record's declarations drive its flags, its config keys and validation."""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass

import pytest

from causalkv.errors import ConfigError
from causalkv.options import Options, option


def _counts(value):
    if isinstance(value, str):
        try:
            value = [int(t) for t in value.split(",")]
        except ValueError:
            raise ConfigError(f"--counts must look like 3,2,4, got {value!r}") from None
    return tuple(value)


@dataclass(frozen=True)
class Knobs(Options):
    title = "tiny knobs"

    counts: tuple[int, ...] | None = option(None, help="chunks per shot", flag="--counts",
                                            parse=_counts, metavar="N,N")
    scale: float = option(1.0, help="a scale", flag="--knob-scale", key="knob_scale", type=float)
    sink: bool = option(True, help="no sink", flag="--no-knob-sink", action="store_false")
    mode: str = option("a", help="mode", flag="--knob-mode", choices=("a", "b"))
    hidden: int = option(3, help="config only")

    def validate(self) -> None:
        if self.scale < 0:
            raise ConfigError(f"--knob-scale must be >= 0, got {self.scale}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="t")
    Knobs.add_arguments(p)
    return p


def test_flags_left_out_are_not_given_and_defaults_come_from_the_record():
    ns = _parser().parse_args([])
    assert Knobs.given_in(ns) == {}
    assert Knobs(**Knobs.given_in(ns)) == Knobs()


def test_given_flags_are_parsed_typed_and_converted():
    ns = _parser().parse_args(["--counts", "3,2", "--knob-scale", "0.5", "--no-knob-sink", "--knob-mode", "b"])
    given = Knobs.given_in(ns)
    assert given == {"counts": (3, 2), "scale": 0.5, "sink": False, "mode": "b"}
    assert Knobs(**given).changed() == given


def test_bad_values_are_refused_by_the_record_or_by_argparse():
    with pytest.raises(ConfigError, match="--counts must look like 3,2,4, got 'x'"):
        Knobs.given_in(_parser().parse_args(["--counts", "x"]))
    with pytest.raises(ConfigError, match="--knob-scale must be >= 0, got -1.0"):
        Knobs(**Knobs.given_in(_parser().parse_args(["--knob-scale", "-1"])))
    with pytest.raises(SystemExit):  # choices
        _parser().parse_args(["--knob-mode", "c"])


def test_config_keys_round_trip_and_unknown_keys_name_the_choices():
    k = Knobs.from_mapping({"counts": [1, 2], "knob_scale": 2.0, "hidden": 5}, source="causalkv.json")
    assert (k.counts, k.scale, k.hidden) == ((1, 2), 2.0, 5)
    assert Knobs.from_mapping(k.to_mapping()) == k
    with pytest.raises(ConfigError) as e:
        Knobs.from_mapping({"scale": 2.0}, source="causalkv.json")
    assert str(e.value) == (
        "causalkv.json: unknown tiny knobs key(s) 'scale'; choose among: counts, knob_scale, "
        "sink, mode, hidden"
    )


def test_help_groups_the_records_flags_under_its_title_with_defaults():
    text = _parser().format_help()
    assert "tiny knobs:" in text
    assert "--knob-scale KNOB_SCALE" in text and "a scale (default: 1.0)" in text
    assert "--hidden" not in text  # config-only field


def test_importing_options_loads_no_torch():
    code = "import sys, causalkv.options; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
