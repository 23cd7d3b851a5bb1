"""Run the vLLM-Omni bridge tests in the vLLM-Omni environment (`make test-vllm-omni`).

One pytest process with ``PYTHONPATH`` starting at ``demo/vllm_omni/cpu_stand_ins`` (its
``sitecustomize`` runs the CPU stand-ins in every process the tests start, the plugin-discovery
subprocess included); this process runs them too, before vLLM is imported.

    .venv-vllm-omni/bin/python tests/vllm_omni_bridge/run.py [test files or nodes] [pytest args]
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
STAND_INS = ROOT / "demo" / "vllm_omni" / "cpu_stand_ins"


def main(argv: list[str]) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # `make test` runs this suite beside two others on two cores: torch's default of one OpenMP
    # thread per core would oversubscribe them, its threads spinning while they wait for each
    # other (the sglang suite's runner measured it: a request denoised 13x faster on one thread)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.pop("CAUSALKV_VLLM_OMNI", None)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(STAND_INS), *[p for p in paths if p != str(STAND_INS)]])
    sys.path.insert(0, str(STAND_INS))
    runpy.run_path(str(STAND_INS / "sitecustomize.py"))
    import pytest

    args = ["-p", "no:cacheprovider", f"--rootdir={ROOT}", "-q"]
    targets = [] if any(Path(a.split("::")[0]).exists() for a in argv) else [str(HERE)]
    return pytest.main(args + targets + argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
