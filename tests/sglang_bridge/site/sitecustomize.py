"""The test session's start-up file: every Python started with this folder on ``PYTHONPATH``
(``tests/sglang_bridge/run.py`` puts it first) runs the CPU stand-ins of
``demo/sglang/cpu_stand_ins`` (their one home, shared with ``make run-sglang``; Python imports
only the first ``sitecustomize`` it finds, so this one runs that one) and then, only with
``CAUSALKV_TEST_REALTIME_PROBE=1``, `realtime_probe` (an observer of a realtime session's KV
caches, test-only). Nothing is installed into any environment, and causalkv never imports
this."""

import os
import runpy
import sys

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ROOT = os.path.dirname(os.path.dirname(_TESTS))
runpy.run_path(os.path.join(_ROOT, "demo", "sglang", "cpu_stand_ins", "sitecustomize.py"))
if os.environ.get("CAUSALKV_TEST_REALTIME_PROBE") == "1":  # the realtime test's servers only
    if _TESTS not in sys.path:
        sys.path.append(_TESTS)
    import realtime_probe  # noqa: E402

    realtime_probe.install()
