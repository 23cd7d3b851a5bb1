"""tests/vllm_omni_bridge runs in the vLLM-Omni environment only (`make test-vllm-omni`, run.py).

The main environment has no vllm-omni: there these modules are not collected. ``demo/vllm_omni``
(the tiny LingBot-World of the CPU demo, `tiny_lingbot`) goes on ``sys.path``; the CPU stand-ins
were run by run.py (or PYTHONPATH) before vLLM was imported.
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
    def runtime():
        """vLLM's and vLLM-Omni's process groups (gloo, one process) for the session."""
        import tiny_lingbot

        with tiny_lingbot.parallel_runtime():
            yield
