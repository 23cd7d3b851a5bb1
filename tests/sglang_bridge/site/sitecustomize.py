"""Test environment only: every Python started with this folder on ``PYTHONPATH`` (the test
session, the ``sglang generate`` processes it starts and the workers they spawn) gets the two
shims a CPU-only sglang needs: `tvshim` (a CUDA-built torchvision imports) and `cpu_kernels`
(sglang's two CPU norm ops), and, with ``CAUSALKV_TEST_REALTIME_PROBE=1``, `realtime_probe`
(an observer of a realtime session's KV caches). ``tests/sglang_bridge/run.py`` and ``make run-sglang`` set
``PYTHONPATH``; nothing is installed into any environment, and causalkv never imports this."""

import os
import sys

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _TESTS not in sys.path:
    sys.path.append(_TESTS)

import cpu_kernels  # noqa: E402
import tvshim  # noqa: E402

tvshim.install()
cpu_kernels.install()
if os.environ.get("CAUSALKV_TEST_REALTIME_PROBE") == "1":  # the realtime test's servers only
    import realtime_probe  # noqa: E402

    realtime_probe.install()
