"""The codec conformance check (`causalkv.caches.codecs.conformance`): every built-in codec
passes it, each declared error bound holds beyond the probe and is not vacuous, broken variants
of the toy plugin codec (tests/toy_codec_plugin.py) each fail naming the codec and the check,
and a broken codec setting is refused on its first use in a process: by `make_codec`, by the
hosts' start-up check, by ``causalkv generate`` before anything loads, and listed as broken by
``causalkv plugins`` (as is a codec whose target does not import)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import toy_codec_plugin
from fault_helpers import ChunkCounter, assert_refused_up_front
from toy_codec_plugin import Int8Codec, Int8Record, WritesZeros

import causalkv.plugin.manager as plugin_manager
from causalkv.caches import codecs
from causalkv.caches.codecs import codec_problem, make_codec
from causalkv.caches.codecs.base import KVCodec, PackedRecord, TensorRecord
from causalkv.caches.codecs.conformance import (
    CHECKS,
    CodecConformanceError,
    check_codec,
    probe_segment,
    stored_tensors,
)
from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.cli.plugins import plugins_report
from causalkv.errors import ConfigError
from causalkv.hooks import CodecRegistration, hookimpl
from causalkv.plugin import collect
from causalkv.plugin.testing import temporary_plugin

HERE = __name__  # the module the broken codecs' "module:Class" targets name

#: built-in settings, and PRQ beyond its defaults
BUILTIN = [
    ("int4", {}), ("int2", {}), ("fp8", {}), ("nvfp4", {}),
    ("int2", {"grid": "mse4"}), ("int4", {"grid": "mse4"}), ("int2", {"asymmetric": True}),
    ("int4", {"asymmetric": True}), ("int2", {"stages": 2}), ("int2", {"block_size": 16, "centroids": 32}),
]


def _id(case: tuple[str, dict]) -> str:
    name, kw = case
    return name + "".join(f"-{k}={v}" for k, v in kw.items())


# ---- the built-in codecs ----------------------------------------------------------------------
@pytest.mark.parametrize("case", BUILTIN, ids=map(_id, BUILTIN))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_every_builtin_codec_passes(case, head_dim):
    name, kw = case
    codec = make_codec(name, QVGKVQuantArgs(codec=name, **kw))
    report = check_codec(codec, head_dim=head_dim)
    shape = (1, 2, 256, head_dim)
    assert report.shape == shape and report.dtype == torch.bfloat16
    assert report.nbytes == codec.nbytes(shape) == sum(t.nbytes for t in stored_tensors(codec.encode(probe_segment(head_dim))))
    assert 0 < report.max_error and 0 < report.bound_used <= 1


def _data(D: int):
    """Segments unlike the probe: zero mean, heavy tails, heads 10**6 apart, an all-zero
    block, channels spanning six decades."""
    g = torch.Generator().manual_seed(7)
    yield torch.randn(1, 2, 192, D, generator=g)
    yield torch.randn(1, 2, 192, D, generator=g) ** 3
    yield torch.randn(1, 2, 192, D, generator=g) * torch.tensor([1e-3, 1e3]).view(1, 2, 1, 1)
    x = torch.randn(1, 2, 192, D, generator=g)
    x[..., :16] = 0
    yield x
    yield torch.randn(1, 2, 192, D, generator=g) * torch.logspace(-6, 0, D).view(1, 1, 1, D)


@pytest.mark.parametrize("case", BUILTIN, ids=map(_id, BUILTIN))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_declared_bound_holds_beyond_the_probe(case, dtype):
    """`KVCodec.error_bound` is derived from the format: it must hold on any data, not only on
    the probe the conformance check draws."""
    name, kw = case
    codec = make_codec(name, QVGKVQuantArgs(codec=name, **kw))
    for x in _data(64):
        x = x.to(dtype)
        got = codec.decode(codec.encode(x), torch.float32).double()
        err = (got - x.double()).abs()
        bound = codec.error_bound(x) + 2.0**-24 * x.double().abs()
        assert bool((err <= bound).all()), float((err / bound.clamp_min(1e-300)).max())


class _ZerosOf:
    """A built-in codec's decode replaced by zeros (the bound must catch it)."""

    def decode_into(self, record, out):
        out.zero_()


@pytest.mark.parametrize("case", BUILTIN, ids=map(_id, BUILTIN))
def test_a_zeros_decode_exceeds_every_builtin_bound(case):
    name, kw = case
    codec = make_codec(name, QVGKVQuantArgs(codec=name, **kw))
    zeros = type(f"Zeros{type(codec).__name__}", (_ZerosOf, type(codec)), {})
    broken = zeros.__new__(zeros)
    broken.__dict__.update(codec.__dict__)
    with pytest.raises(CodecConformanceError) as e:
        check_codec(broken, head_dim=64)
    assert e.value.check == "bound"


# ---- broken variants of the toy plugin codec -----------------------------------------------------
class ShortRecord(Int8Codec):
    """A record one token shorter than it claims."""

    def encode(self, x, *, seed=1234, head_offset=0, codebooks=None):
        record = super().encode(x[:, :, :-1])
        return Int8Record(tuple(x.shape), x.dtype, record.parts)


class QuarterBytes(Int8Codec):
    """``nbytes`` claims a quarter of the truth."""

    def nbytes(self, shape):
        return super().nbytes(shape) // 4


class RaisingEncode(Int8Codec):
    def encode(self, x, *, seed=1234, head_offset=0, codebooks=None):
        raise RuntimeError("the encoder fails on purpose\n(a second line the message leaves out)")


class WritesNothing(Int8Codec):
    def decode_into(self, record, out):
        self.check_out(record, out)


class ContiguousOnly(Int8Codec):
    """Decodes through ``out.view``: fails on the strided views the cache passes."""

    def decode_into(self, record, out):
        self.check_out(record, out)
        out.view(-1).copy_((record.parts["values"].float() * record.parts["scales"]).reshape(-1))


class UnregisteredRecord(TensorRecord):
    pass


class Unregistered(Int8Codec):
    def encode(self, x, *, seed=1234, head_offset=0, codebooks=None):
        r = super().encode(x)
        return UnregisteredRecord(r.shape, r.dtype, r.parts)


class WrongShape(Int8Codec):
    def encode(self, x, *, seed=1234, head_offset=0, codebooks=None):
        r = super().encode(x)
        B, H, S, D = r.shape
        return Int8Record((B, H, S, D // 2), r.dtype, r.parts)


class OneHeadOff(Int8Codec):
    """Decodes the second head from the first one's values: right shape, wrong numbers."""

    def decode_into(self, record, out):
        super().decode_into(record, out)
        out[:, 1:] = out[:, :1]


BROKEN = [
    (ShortRecord, "parts", "part 'values' is [1, 2, 255, 64]"),
    (QuarterBytes, "nbytes", "nbytes((1, 2, 256, 64)) = 8,704 B, record.nbytes = 34,816 B, the tensors the record holds = 34,816 B"),
    (RaisingEncode, "encode", "raised RuntimeError: the encoder fails on purpose"),
    (WritesNothing, "finite", "left 32,768 of 32,768 elements"),
    (WritesZeros, "bound", "off by"),
    (ContiguousOnly, "decode", "raised RuntimeError"),
    (Unregistered, "record", "UnregisteredRecord is not registered"),
    (WrongShape, "shape", "the record claims shape (1, 2, 256, 32)"),
    (OneHeadOff, "bound", "element [0, 1,"),
]


@pytest.mark.parametrize(("cls", "check", "problem"), BROKEN, ids=[c.__name__ for c, _, _ in BROKEN])
def test_each_broken_variant_fails_naming_the_codec_and_the_check(cls, check, problem):
    with pytest.raises(CodecConformanceError) as e:
        check_codec(cls(), head_dim=64)
    exc = e.value
    assert exc.check == check and check in CHECKS
    line = str(exc)
    assert "\n" not in line
    assert line.startswith(f"KV codec 'int8' ({cls.__module__}:{cls.__name__}) failed the conformance check '{check}': ")
    assert problem in exc.problem, exc.problem
    assert exc.fix and line.endswith(exc.fix)
    assert isinstance(exc, ValueError)


def test_the_toy_codec_itself_passes_and_its_bound_is_tight():
    report = check_codec(Int8Codec(), head_dim=64)
    assert report.nbytes == 256 * 2 * (64 + 4)
    assert 0.5 < report.bound_used <= 1  # half a step is reached on 32,768 draws


def test_a_record_without_the_protocol_is_refused():
    class Bare(Int8Codec):
        def encode(self, x, *, seed=1234, head_offset=0, codebooks=None):
            return super().encode(x).parts["values"]

    with pytest.raises(CodecConformanceError, match="'record': encode returned a Tensor without") as e:
        check_codec(Bare(), head_dim=64)
    assert not isinstance(torch.zeros(1), PackedRecord) and e.value.check == "record"


def test_a_head_dim_the_codec_refuses_is_the_callers_error():
    codec = make_codec("nvfp4", QVGKVQuantArgs(codec="nvfp4"))
    with pytest.raises(ValueError, match="cannot pack head_dim=40"):
        check_codec(codec, head_dim=40)


def test_the_default_bound_allows_half_a_token_heads_magnitude():
    x = torch.tensor([[[[1.0, -4.0, 2.0], [0.5, 0.0, 0.25]]]])
    bound = KVCodec.error_bound(Int8Codec(), x)
    assert bound.dtype == torch.float64 and bound.tolist() == [[[[2.0] * 3, [0.25] * 3]]]


# ---- first use in a process ---------------------------------------------------------------------
class Counting(Int8Codec):
    encodes = 0

    def encode(self, x, *, seed=1234, head_offset=0, codebooks=None):
        type(self).encodes += 1
        return super().encode(x)


class CountingZeros(WritesZeros):
    encodes = 0

    def encode(self, x, *, seed=1234, head_offset=0, codebooks=None):
        type(self).encodes += 1
        return super().encode(x)


@pytest.fixture
def registry(monkeypatch):
    """The codec registry restored afterwards."""
    monkeypatch.setattr(codecs, "_SETTINGS", dict(codecs._SETTINGS))
    return codecs


def test_a_setting_is_checked_once_per_process_and_geometry(registry):
    registry.register_codec("i8count", f"{HERE}:Counting")
    q = QVGKVQuantArgs(codec="i8count")
    make_codec("i8count", q)  # the first use: checked at the default head_dim (128)
    assert Counting.encodes == 1
    make_codec("i8count", q)
    assert codec_problem("i8count", q, 128) is None and Counting.encodes == 1  # remembered
    assert q.layout_problem(64) is None and Counting.encodes == 2  # a new geometry
    assert q.layout_problem(64) is None and Counting.encodes == 2
    make_codec("i8count", q)
    assert Counting.encodes == 2


def test_a_broken_setting_is_refused_at_each_use_checked_once(registry):
    registry.register_codec("i8zeros", f"{HERE}:CountingZeros")
    q = QVGKVQuantArgs(codec="i8zeros")
    for _ in range(2):
        with pytest.raises(CodecConformanceError) as e:
            make_codec("i8zeros", q)
        assert e.value.check == "bound"
        assert str(e.value).startswith(
            f"KV codec setting 'i8zeros' ({HERE}:CountingZeros) failed the conformance check 'bound': ")
    assert CountingZeros.encodes == 1
    # the hosts' start-up check: one ConfigError line naming the setting and the check
    with pytest.raises(ConfigError) as e:
        q.check_layout(64)
    line = str(e.value)
    assert "\n" not in line and "setting 'i8zeros'" in line and "conformance check 'bound'" in line
    assert CountingZeros.encodes == 2  # checked once at head_dim 64 too


class SettingGone(Int8Codec):
    """Raises the ConfigError a wrong setting gives (PRQ's CAUSALKV_QVG_BACKEND=bogus) until
    ``fixed``."""
    fixed = False
    encodes = 0

    def encode(self, x, *, seed=1234, head_offset=0, codebooks=None):
        type(self).encodes += 1
        if not type(self).fixed:
            raise ConfigError("I8_BACKEND='bogus': choose one of ['auto']")
        return super().encode(x)


def test_a_wrong_setting_is_the_users_error_and_not_remembered(registry, monkeypatch):
    registry.register_codec("i8setting", f"{HERE}:SettingGone")
    q = QVGKVQuantArgs(codec="i8setting")
    with pytest.raises(ConfigError) as e:
        make_codec("i8setting", q)
    # the setting's own message, not a conformance failure blamed on the codec
    assert not isinstance(e.value, CodecConformanceError)
    assert str(e.value) == "I8_BACKEND='bogus': choose one of ['auto']"
    monkeypatch.setattr(SettingGone, "fixed", True)
    make_codec("i8setting", q)  # checked again once the setting is fixed, and passes
    assert SettingGone.encodes == 2


def test_the_recency_tier_codec_is_checked_too(registry):
    registry.register_codec("i8short", f"{HERE}:ShortRecord")
    q = QVGKVQuantArgs(codec="fp8", recent_tier="i8short")
    problem = q.layout_problem(64)
    assert problem is not None and "setting 'i8short'" in problem and "check 'parts'" in problem


class _BrokenPlugin:
    @hookimpl
    def causalkv_register_codecs(self):
        return [CodecRegistration("i8nothing", f"{HERE}:WritesNothing", help="decodes nothing"),
                CodecRegistration("i8gone", "no_such_module_anywhere:Codec", help="not importable")]


def test_generate_refuses_a_broken_plugin_codec_before_anything_loads(
    registry, tmp_path: Path, empty_home: Path, counter: ChunkCounter, loads: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    plugin_manager._default.register_plugin(_BrokenPlugin(), "broken-codecs")
    line = assert_refused_up_front(
        ["--kv-cache-quant", "i8nothing", "--no-video"],
        ["setting 'i8nothing'", f"({HERE}:WritesNothing)", "conformance check 'finite'",
         "decode_into must write every element of out"],
        tmp_path, empty_home, counter, loads, capsys,
    )
    assert line.startswith("causalkv generate: error: ")


def test_plugins_lists_a_codec_that_does_not_import_or_conform_as_broken(registry, pm, capsys):
    from causalkv.cli.plugins import _print_plugins

    with temporary_plugin(pm, _BrokenPlugin(), name="broken-codecs"):
        collect(pm, report=None)
        report = plugins_report(pm, include_builtin=False)
    rows = {c["name"]: c for c in report["codecs"]}
    assert "cannot import 'no_such_module_anywhere:Codec'" in rows["i8gone"]["error"]
    assert "No module named 'no_such_module_anywhere'" in rows["i8gone"]["error"]
    assert "conformance check 'finite'" in rows["i8nothing"]["error"]
    assert all("error" not in rows[n] for n in ("int4", "int2", "fp8", "nvfp4"))
    _print_plugins(report)
    out = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(out) if line.startswith("  i8gone ("))
    assert out[at + 1].startswith("      error: codec setting 'i8gone': cannot import")


def test_the_toy_plugin_codec_passes_through_its_registration(registry, pm):
    with temporary_plugin(pm, toy_codec_plugin, name="toy-codec"):
        collect(pm, report=None)
        assert QVGKVQuantArgs(codec="int8").layout_problem(64) is None
        assert "error" not in {c["name"]: c for c in plugins_report(pm, include_builtin=False)["codecs"]}["int8"]
