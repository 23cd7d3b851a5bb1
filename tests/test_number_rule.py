"""One rule for "a finite number": `causalkv.errors.is_number` (an int or a float, not a bool,
not NaN or infinite) is the test behind every number setting (``--guidance-scale``,
``--seconds``, the multi-shot RoPE offset, ``causalkv.json``'s numbers, vLLM-Omni's
``gpu_memory_fraction``, the packed-attention scale); each entry point keeps its own bounds and
its own message. The oracle is Python's own notion: a finite real that is not a bool.

And one rule for the fix a grid refusal offers (``--frames``, ``--height``/``--width``, latent
frames per chunk): `causalkv.errors.multiples_around`, checked against an enumeration."""

from __future__ import annotations

import math

import pytest

from causalkv.config import ServerArgs
from causalkv.errors import ConfigError, alternatives, is_int, is_number, multiples_around
from causalkv.stages.families import ShotRequest


@pytest.mark.parametrize("value", [0, 1, -2.5, 1e300, 2**70, 10**400])  # 10**400 overflows a float
def test_finite_ints_and_floats_are_numbers(value: object) -> None:
    assert is_number(value)


@pytest.mark.parametrize("value", [True, False, math.nan, math.inf, -math.inf, "1", None, 1j, [1.0]])
def test_bools_non_finite_values_and_other_types_are_not(value: object) -> None:
    assert not is_number(value)


@pytest.mark.parametrize("value", [True, math.nan, math.inf, "2"])
def test_the_guidance_scale_refuses_what_is_not_a_number(value: object) -> None:
    with pytest.raises(ConfigError, match=r"guidance scale must be a finite number >= 0, got .* \(--guidance-scale\)"):
        ServerArgs(guidance_scale=value)


@pytest.mark.parametrize("value", [True, math.nan, math.inf, "2"])
def test_the_multi_shot_rope_offset_refuses_what_is_not_a_number(value: object) -> None:
    with pytest.raises(ConfigError, match="multi-shot RoPE offset must be a finite number >= 0"):
        ShotRequest(multi_shot_rope_offset=value)


@pytest.mark.parametrize(("value", "unit", "base", "expected"), [
    (13, 4, 0, [12, 16]),  # between two multiples: both
    (3, 4, 0, [4]),        # below the first multiple: 0 is no fix
    (7, 4, 1, [5, 9]),     # 1 + a multiple of 4 (video frames from latent frames)
    (3, 4, 1, [1, 5]),     # one frame is 1 + 0 x 4
])
def test_a_refusal_offers_the_grid_values_around_the_value(value, unit, base, expected) -> None:
    # the oracle: every positive grid value within one unit of the value, by enumeration
    grid = [base + k * unit for k in range(0, value // unit + 3)]
    assert multiples_around(value, unit, base) == [g for g in grid if g > 0 and abs(g - value) < unit] == expected


@pytest.mark.parametrize(("value", "minimum", "expected"), [
    (-5, None, True), (0, None, True), (True, None, False), (1.0, None, False), ("1", None, False),
    (0, 1, False), (1, 1, True), (0, 0, True), (False, 0, False),
])
def test_an_int_is_an_int_and_not_a_bool(value: object, minimum: int | None, expected: bool) -> None:
    assert is_int(value, minimum) is expected


def test_alternatives_are_said_with_or() -> None:
    assert alternatives([12, 16]) == "12 or 16"
    assert alternatives(iter([4])) == "4"
    assert alternatives(multiples_around(13, 4)) == "12 or 16"


@pytest.mark.parametrize(("name", "value"), [("RANK", "x"), ("WORLD_SIZE", "2.0"), ("LOCAL_RANK", "")])
def test_torchruns_environment_is_read_once_and_a_bad_value_is_named(
        monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    from causalkv.runtime.processes.launch import env_world

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert env_world() == (0, 1, 0, 1)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert env_world() == (3, 4, 3, 4)  # one node: the local rank and size default to the global
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=f"{name}={value!r} is not an int: torchrun sets it"):
        env_world()
