"""tests/sglang_bridge runs in the sglang environment only (`make test-sglang`, its run.py).

The main environment has no sglang: there these modules are not collected (they run in the
same `make test`, in .venv-sglang, right after the main suite).
"""

import importlib.util

if importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["test_*.py"]
