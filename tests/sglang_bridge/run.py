"""Run the sglang bridge tests in the sglang environment: ours, then sglang's own unit tests.

One pytest process, with ``PYTHONPATH`` pointing at ``site/`` (its ``sitecustomize`` runs the
CPU stand-ins of ``demo/sglang/cpu_stand_ins`` in every process the tests start),
`ckv_sglang_pytest` loaded first (it applies causalkv's hooks through sglang's own plugin
lifecycle). sglang's test files run from the installed package, minus the tests in
`DESELECTED` that assert the very refusal the bridge removes.

    .venv-sglang/bin/python tests/sglang_bridge/run.py [extra pytest args]
    .venv-sglang/bin/python tests/sglang_bridge/run.py -n 2 --dist loadfile   # as make test
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: sglang's unit test files run with the hooks applied (paths inside the installed package)
SGLANG_TEST_FILES = (
    "test_qvg_packed_kv.py",
    "test_diffusion_plugins.py",
    "test_longlive2_pipeline_config.py",
    "realtime/test_causal_denoising.py",
    "realtime/test_lingbot_causal_denoising.py",
)

#: sglang tests asserting a refusal the bridge removes, with why
DESELECTED = {
    "test_qvg_packed_kv.py::TestPackedStorageEquivalence::"
    "test_quantization_is_rejected_by_unsupported_causal_stages":
        "asserts that CausalDMDDenoisingStage refuses QVG; the bridge serves it",
}


def sglang_unit_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("sglang.multimodal_gen.test.unit")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("sglang's unit tests are not installed (sglang==0.5.23 ships them)")
    return Path(next(iter(spec.submodule_search_locations)))


def main(argv: list[str]) -> int:
    import pytest

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # one torch thread per process (this one, its xdist workers, every sglang they start):
    # `make test` runs two workers on two cores, each with sglang processes of its own, and
    # torch's default of one thread per core oversubscribes them: its OpenMP threads spin
    # waiting for each other (measured under load: one LongLive 2.0 request of test_e2e_cli
    # denoised in 9.0 s and decoded in 14.1 s with two threads, 0.7 s and 2.5 s with one)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # the suite states which hooks sglang applies; the fused route's tests turn it on themselves
    os.environ.pop("CAUSALKV_SGLANG_FUSED_ATTENTION", None)
    # every process the tests start (`sglang generate`, DiffGenerator's workers) runs
    # site/sitecustomize.py: the CPU stand-ins (demo/sglang/cpu_stand_ins), the realtime probe
    # (and this folder, for `-p ckv_sglang_pytest` in pytest-xdist's workers: `-n 2`)
    site = str(HERE / "site")
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [site, str(HERE), *[p for p in paths if p not in (site, str(HERE))]])
    sys.path.insert(0, str(HERE))
    # and so does this one, before sglang is imported (even locating its tests imports
    # torchvision); it puts the stand-ins' folder on sys.path for ckv_sglang_pytest
    runpy.run_path(str(HERE / "site" / "sitecustomize.py"))
    unit = sglang_unit_dir()
    root = HERE.parent.parent
    args = ["-p", "ckv_sglang_pytest", "-p", "no:cacheprovider", f"--rootdir={root}", "-q"]
    args += [str(HERE)] + [str(unit / f) for f in SGLANG_TEST_FILES]
    return pytest.main(args + argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
