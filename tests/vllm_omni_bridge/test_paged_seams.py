"""The seams of causalkv's paged path (`causalkv.vllm_omni.paged_seams`) against the installed
vLLM-Omni 0.30.0: every one is there, and a vLLM-Omni lacking one is refused in one line naming
it and the version it was read from."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from causalkv.errors import ConfigError
from causalkv.vllm_omni import paged_seams
from causalkv.vllm_omni.paged_seams import READ_FROM, SEAMS, Seam, check_seams, missing_seams

ROOT = Path(__file__).resolve().parents[2]


def test_installed_release_is_the_one_read_and_has_every_seam():
    omni, vllm = paged_seams.installed_versions()
    assert (omni, vllm) == (READ_FROM, paged_seams.VLLM_READ_FROM)
    assert missing_seams() == []
    check_seams()  # nothing raised


def test_seams_name_distinct_things_of_the_experimental_package():
    keys = [(s.module, s.path, s.kind) for s in SEAMS]
    assert len(keys) == len(set(keys))
    assert {s.kind for s in SEAMS} == {"attribute", "parameter", "field", "instance"}
    ar = [s for s in SEAMS if s.module.startswith("vllm_omni.experimental.ar_diffusion")]
    assert len(ar) >= 20
    for seam in SEAMS:
        assert seam.why and seam.where.startswith(seam.module + ".")


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_a_missing_method_is_refused_by_name(monkeypatch):
    from vllm_omni.experimental.ar_diffusion.kv_cache.manager import ARDiffusionKVCache

    monkeypatch.delattr(ARDiffusionKVCache, "commit_chunk")
    with pytest.raises(ConfigError) as exc:
        check_seams()
    text = _one_line(exc)
    assert "vllm_omni.experimental.ar_diffusion.kv_cache.manager.ARDiffusionKVCache.commit_chunk" in text
    assert f"read from vLLM-Omni {READ_FROM}" in text and f"installed vLLM-Omni {READ_FROM}" in text
    assert "no such name" in text and "install vllm-omni==0.30.0" in text
    # every other seam is still there: the refusal names exactly one
    assert [s.path for s, _ in missing_seams()] == ["ARDiffusionKVCache.commit_chunk"]


def test_a_missing_module_global_is_refused(monkeypatch):
    from vllm_omni.diffusion.models.lingbot_world import transformer

    monkeypatch.delattr(transformer, "paged_write_attn")
    with pytest.raises(ConfigError, match=r"lingbot_world\.transformer\.paged_write_attn \(attribute: "
                                          r"no such name"):
        check_seams()


def test_a_missing_parameter_field_and_instance_attribute_are_refused():
    fake = (
        Seam("vllm_omni.experimental.ar_diffusion.kv_cache.manager", "ARDiffusionKVCache.__init__",
             "parameter", "test", ("config", "page_bytes_per_session")),
        Seam("vllm_omni.experimental.ar_diffusion.capability", "ARDiffusionKVCacheSpec", "field",
             "test", ("num_layers", "page_size_bytes")),
        Seam("vllm_omni.experimental.ar_diffusion.kv_cache.manager", "ARDiffusionKVCache", "instance",
             "test", ("manager", "packed_pool")),
        Seam("vllm_omni.experimental.ar_diffusion.no_such_module", "X", "attribute", "test"),
    )
    got = {s.path: problem for s, problem in missing_seams(fake)}
    assert got["ARDiffusionKVCache.__init__"] == "no parameter(s) ['page_bytes_per_session']"
    assert got["ARDiffusionKVCacheSpec"] == "no field(s) ['page_size_bytes']"
    assert got["ARDiffusionKVCache"] == "no attribute(s) ['packed_pool'] on an instance"
    assert got["X"].startswith("cannot import vllm_omni.experimental.ar_diffusion.no_such_module")
    with pytest.raises(ConfigError) as exc:
        check_seams(fake)
    assert "(and 3 more)" in _one_line(exc)


def test_an_instance_that_cannot_be_built_is_refused():
    seam = (Seam("vllm_omni.experimental.ar_diffusion.kv_cache.manager", "ARDiffusionKVCache",
                 "instance", "test", ("manager",)),)

    def broken():
        raise TypeError("__init__() got an unexpected keyword argument 'frames_per_block'")

    with pytest.raises(ConfigError, match="cannot be built without tensors \\(TypeError: "):
        check_seams(seam, probe=broken)


def test_importing_the_seams_imports_no_vllm():
    code = ("import sys, causalkv.vllm_omni.paged_seams as s\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in ('vllm', 'vllm_omni', 'torch')], "
            "sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'vllm_omni', 'torch'))[:5]\n"
            "print(len(s.SEAMS))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no CPU stand-ins (torch)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == len(SEAMS)
