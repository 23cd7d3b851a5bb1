"""tests/vllm_omni_bridge runs in the vLLM-Omni environment only (`make test-vllm-omni`, run.py).

The main environment has no vllm-omni: there these modules are not collected. ``demo/vllm_omni``
(the tiny LingBot-World DiT, `tiny_lingbot`) goes on ``sys.path``; the CPU stand-ins were run by
run.py (or PYTHONPATH) before vLLM was imported.
"""

import importlib.util
import sys
from pathlib import Path

_DEMO = str(Path(__file__).resolve().parents[2] / "demo" / "vllm_omni")
if _DEMO not in sys.path:
    sys.path.insert(0, _DEMO)

if importlib.util.find_spec("vllm_omni") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    import pytest

    @pytest.fixture(scope="session")
    def ranks(tmp_path_factory):
        """Two fresh gloo processes (``ulysses_worker.py``): vLLM-Omni's plugin loader in each
        (``discovery``: rank -> what LingBot-World's pipeline resolved to), then the tiny DiT
        under vLLM-Omni's Ulysses hooks (``outputs``: (mode, rank) -> outputs, head offset);
        ``logs``: each process's output. Shared by test_discovery.py and test_ulysses.py."""
        import json
        import os
        import subprocess

        import torch

        out = tmp_path_factory.mktemp("ranks")
        rendezvous = str(out / "rendezvous")  # a file, not a port: nothing else can take it
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "CAUSALKV_VLLM_OMNI",
                            "VLLM_PLUGINS")}
        worker = str(Path(__file__).resolve().parent / "ulysses_worker.py")
        procs = [subprocess.Popen([sys.executable, worker, str(r), "2", "dense,int2", str(out), rendezvous],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(2)]
        logs = [p.communicate(timeout=1200)[0] for p in procs]
        for p, log in zip(procs, logs):
            assert p.returncode == 0, log[-4000:]
        return {
            "discovery": {r: json.loads((out / f"discovery-{r}.json").read_text()) for r in range(2)},
            "outputs": {(m, r): torch.load(out / f"{m}-2-{r}.pt") for m in ("dense", "int2")
                        for r in range(2)},
            "logs": logs,
        }

    @pytest.fixture(scope="module")
    def runtime():
        """vLLM's and vLLM-Omni's process groups (gloo, one process) for a test module: torn
        down when the module ends, so a module that starts vLLM-Omni's own engine in this
        process (tests/vllm_omni_bridge/test_paged_engine.py: ``Omni`` makes its own groups)
        finds none left over."""
        import tiny_lingbot

        with tiny_lingbot.parallel_runtime():
            yield
