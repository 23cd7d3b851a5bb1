"""CPU stand-ins for the two pieces of sglang's GPU stack that a CPU-only machine lacks, for
the CPU demo (``make run-sglang``) and causalkv's own sglang tests.

Python imports ``sitecustomize`` at start-up from the first ``PYTHONPATH`` folder that has
one, so every process started with this folder on ``PYTHONPATH`` (``sglang generate``, the
worker processes sglang spawns, a pytest session) gets them before sglang is imported:

- `tvshim`: lets the registry's CUDA-built torchvision import on a CPU-only torch;
- `cpu_kernels`: plain-PyTorch CPU kernels of sglang's two fused norm ops
  (``torch.ops.sgl_kernel.fused_*_cpu``), which live in sglang's GPU kernel wheel.

Each defines something only when it is missing (a torchvision whose extension loads, an
``sgl_kernel`` that has the ops: nothing happens). This folder is not part of the causalkv
distribution: ``pip install causalkv`` never installs it, causalkv never imports it, and a GPU
machine running sglang with causalkv installed never loads it unless someone puts this
folder on its ``PYTHONPATH``. docs/sglang.md ("Running on a CPU") describes it.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # also when run by another sitecustomize (the tests' own)
    sys.path.append(_HERE)

import cpu_kernels  # noqa: E402
import tvshim  # noqa: E402

tvshim.install()
cpu_kernels.install()
