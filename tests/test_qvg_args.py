"""QVGKVQuantArgs: reference defaults, dict keys, CLI flags and validation messages (the reference runtime's, docs/qvg.md)."""

from __future__ import annotations

import argparse

import pytest

from causalkv.caches.qvg import QVGKVQuantArgs


def _parse(*argv: str) -> QVGKVQuantArgs:
    return QVGKVQuantArgs(**QVGKVQuantArgs.given_in(_parser().parse_args(list(argv))))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    QVGKVQuantArgs.add_arguments(parser)
    return parser


def test_reference_defaults():
    a = QVGKVQuantArgs()
    assert (a.bits, a.centroids, a.block_size, a.stages, a.kmeans_iters) == (None, 128, 64, 1, 2)
    assert (a.asymmetric, a.keep_recent_chunks, a.sink, a.sink_span, a.sink_keep_chunks) == (
        False, 1, True, "chunk", 0)
    assert not a.enabled and a.describe() == "off"
    assert QVGKVQuantArgs(codec="int2").enabled


def test_from_dict_reads_the_reference_keys():
    a = QVGKVQuantArgs.from_dict({
        "kv_cache_quant": "int4",
        "kv_cache_quant_centroids": 64,
        "kv_cache_quant_block_size": 32,
        "kv_cache_quant_stages": 2,
        "kv_cache_quant_iters": 5,
        "kv_cache_quant_keep_recent": 3,
        "kv_cache_quant_sink_keep": 1,
        "kv_cache_quant_asymmetric": 1,
        "kv_cache_quant_sink": 0,
        "kv_cache_quant_sink_span": "full",
        "unrelated_key": 123,
    })
    assert a == QVGKVQuantArgs(codec="int4", centroids=64, block_size=32, stages=2, kmeans_iters=5,
                               keep_recent_chunks=3, sink_keep_chunks=1, asymmetric=True,
                               sink=False, sink_span="full")
    assert QVGKVQuantArgs.from_dict({"kv_cache_quant": "off"}) == QVGKVQuantArgs()
    assert QVGKVQuantArgs.from_dict({"kv_cache_quant": 2}).bits == 2


def test_flags():
    assert _parse() == QVGKVQuantArgs()
    a = _parse("--kv-cache-quant", "int2", "--kv-cache-quant-centroids", "256",
               "--kv-cache-quant-block-size", "16", "--kv-cache-quant-stages", "2",
               "--kv-cache-quant-iters", "4", "--kv-cache-quant-keep-recent", "2",
               "--kv-cache-quant-sink-keep", "1", "--kv-cache-quant-asymmetric",
               "--kv-cache-quant-sink", "0")
    assert a == QVGKVQuantArgs(codec="int2", centroids=256, block_size=16, stages=2, kmeans_iters=4,
                               keep_recent_chunks=2, sink_keep_chunks=1, asymmetric=True,
                               sink=False)
    assert _parse("--kv-cache-quant", "int4", "--kv-cache-quant-grid", "mse4").grid == "mse4"
    with pytest.raises(SystemExit):
        _parser().parse_args(["--kv-cache-quant", "int8"])
    with pytest.raises(SystemExit):
        _parser().parse_args(["--kv-cache-quant-sink", "2"])


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(codec="int3"), "unknown KV codec 'int3'"),
        (dict(codec="int2", centroids=0), "kv-cache-quant-centroids must be > 0"),
        (dict(codec="int2", block_size=-1), "kv-cache-quant-block-size must be > 0"),
        (dict(codec="int2", stages=0), "kv-cache-quant-stages must be > 0"),
        (dict(codec="int2", kmeans_iters=0), "kv-cache-quant-iters must be > 0"),
        (dict(codec="int2", centroids=257), "kv-cache-quant-centroids must be <= 256"),
        (dict(codec="int2", keep_recent_chunks=-1), "kv-cache-quant-keep-recent must be >= 0"),
        (dict(codec="int2", sink_span="frames"), "kv-cache-quant-sink-span must be one of"),
        (dict(codec="int2", grid="nf4"), "kv-cache-quant-grid must be one of"),
    ],
)
def test_validate_messages(kwargs, message):
    with pytest.raises(ValueError, match=message):
        QVGKVQuantArgs(**kwargs).validate()


def test_bad_quant_name_message():
    with pytest.raises(ValueError) as e:
        QVGKVQuantArgs.from_dict({"kv_cache_quant": "int8"})
    assert str(e.value) == "kv-cache-quant must be one of ['off', 'int4', 'int2', 'fp8', 'nvfp4'], got 'int8'"


def test_describe():
    text = QVGKVQuantArgs(codec="int2", grid="mse4", block_size=16).describe()
    assert text.startswith("qvg(int2, centroids=128, block=16, stages=1, iters=2, sym,")
    assert "grid=mse4" in text
    assert "grid" not in QVGKVQuantArgs(codec="int4").describe()


def test_block_size_with_quant_off_is_not_a_layout():
    """Off packs nothing: a block size that could not pack is not an error until bits are set."""
    assert QVGKVQuantArgs(block_size=7).layout_problem(128) is None


@pytest.mark.parametrize(
    "kwargs,head_dim,problem",
    [
        (dict(codec="int2", block_size=64), 128, None),
        (dict(codec="int2", block_size=48), 128,
         "kv-cache-quant-block-size 48 does not divide head_dim=128; choose one of "
         "[4, 8, 16, 32, 64, 128]"),
        (dict(codec="int4", block_size=64), 32,
         "kv-cache-quant-block-size 64 does not divide head_dim=32; choose one of [2, 4, 8, 16, 32]"),
        # PRQ's other block-size rule, said first: a block's codes fill whole bytes
        (dict(codec="int2", block_size=7), 128,
         "kv-cache-quant-block-size 7 x 2 bits is not a whole number of bytes; use a block size "
         "divisible by 4"),
        (dict(codec="int4", block_size=3), 48,
         "kv-cache-quant-block-size 3 x 4 bits is not a whole number of bytes; use a block size "
         "divisible by 2"),
    ],
)
def test_layout_problem_names_the_flag_and_the_divisors(kwargs, head_dim, problem):
    args = QVGKVQuantArgs(**kwargs)
    assert args.layout_problem(head_dim) == problem
    if problem is None:
        assert args.check_layout(head_dim) is args
    else:
        with pytest.raises(ValueError, match=problem.replace("[", r"\[").replace("]", r"\]")):
            args.check_layout(head_dim)


@pytest.mark.parametrize(("kwargs", "head_dim", "problem"), [
    (dict(codec="fp8", recent_tier="int2", block_size=7), 56,
     "kv-cache-quant-block-size 7 x 2 bits is not a whole number of bytes; use a block size "
     "divisible by 4"),
    (dict(codec="nvfp4", recent_tier="int4", block_size=3), 48,
     "kv-cache-quant-block-size 3 x 4 bits is not a whole number of bytes; use a block size "
     "divisible by 2"),
])
def test_a_prq_recency_tier_gets_prqs_block_size_refusal(kwargs, head_dim, problem):
    """PRQ packs each scale block's codes in whole bytes (docs/qvg.md): a block size that does
    not is refused by PRQ's own layout rule with the flag and the fix, wherever PRQ packs: as
    the recency tier too, not only as the codec (the block divides ``head_dim`` here, so only
    that rule can refuse it)."""
    args = QVGKVQuantArgs(**kwargs)
    assert args.layout_problem(head_dim) == problem


def test_importing_the_settings_loads_no_torch():
    """The QVG settings are torch-free: the record imports without torch (the caches packages
    export lazily)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import causalkv.caches.qvg.options\n"
        "from causalkv.caches.qvg import QVGKVQuantArgs\n"
        "assert QVGKVQuantArgs(codec='int2').codec_options.bits == 2\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_parts_are_declared_once_and_make_up_the_whole():
    from causalkv.caches.qvg.options import QVGCodecOptions, QVGPackingOptions

    a = QVGKVQuantArgs(codec="int4", centroids=64, keep_recent_chunks=2, grid="mse4")
    assert a.codec_options == QVGCodecOptions(codec="int4", centroids=64, grid="mse4")
    assert a.packing == QVGPackingOptions(keep_recent_chunks=2)
    assert set(QVGKVQuantArgs.specs()) == set(QVGCodecOptions.specs()) | set(QVGPackingOptions.specs())
    assert not set(QVGCodecOptions.specs()) & set(QVGPackingOptions.specs())
    # the reference runtime's dict keys and flags come from the declarations
    assert QVGKVQuantArgs.keys()["kv_cache_quant_iters"] == "kmeans_iters"
    assert QVGKVQuantArgs.flags()["--kv-cache-quant-keep-recent"] == "keep_recent_chunks"


def test_every_exported_name_resolves():
    """``causalkv.caches.qvg`` exports its names lazily: each one in ``__all__`` imports (a
    stale entry made ``from causalkv.caches.qvg import *`` raise AttributeError)."""
    import causalkv.caches.qvg as qvg

    for name in qvg.__all__:
        assert getattr(qvg, name) is not None, name
    assert qvg.quant_choices()[0] == "off" and "int2" in qvg.quant_choices()
    assert qvg.recent_tiers()[0] == "bf16"
    namespace: dict = {}
    exec("from causalkv.caches.qvg import *", namespace)
    assert set(qvg.__all__) <= set(namespace)


@pytest.mark.parametrize(("kwargs", "problem"), [
    (dict(codec="fp8", centroids=64),
     "--kv-cache-quant-centroids 64: --kv-cache-quant fp8 does not read it (read by int4, int2); "
     "drop the flag, or choose a codec that reads it"),
    (dict(codec="nvfp4", recent_tier="fp8", asymmetric=True),
     "--kv-cache-quant-asymmetric True: --kv-cache-quant nvfp4 with --kv-cache-quant-recent-tier "
     "fp8 does not read it (read by int4, int2); drop the flag, or choose a codec that reads it"),
    (dict(codec="fp8", grid="mse4"), "--kv-cache-quant-grid 'mse4': --kv-cache-quant fp8 does"),
    (dict(codec="int2", centroids=64), None),  # PRQ reads it
    (dict(codec="fp8", recent_tier="int4", centroids=64), None),  # the recency tier reads it
    (dict(codec="fp8"), None),  # PRQ's defaults are not a request
])
def test_a_codec_option_no_codec_in_use_reads_is_refused(kwargs, problem):
    """A PRQ knob with fp8 or nvfp4 is refused at start-up, naming the flag, the codec and the
    codecs that read it, never silently ignored (`KVCodec.reads`)."""
    got = QVGKVQuantArgs(**kwargs).layout_problem(128)
    assert got == problem if problem is None or problem.endswith("reads it") else got.startswith(problem)


def test_the_command_line_refuses_an_unread_codec_option_before_loading(capsys):
    from fault_helpers import one_line, run_cli

    rc = run_cli(["generate", "--kv-cache-quant", "fp8", "--kv-cache-quant-centroids", "64"])
    err = one_line(capsys.readouterr().err)
    assert rc == 2
    assert err == ("causalkv generate: error: --kv-cache-quant-centroids 64: --kv-cache-quant fp8 "
                   "does not read it (read by int4, int2); drop the flag, or choose a codec that "
                   "reads it")
