"""CPU stand-ins for vLLM-Omni 0.30.0 on a CPU-only machine, for causalkv's CPU demo
(``make run-vllm-omni``) and tests (``tests/vllm_omni_bridge``). Never imported by causalkv.

Python imports ``sitecustomize`` at start-up from the first ``PYTHONPATH`` folder that has one,
so every process started with this folder on ``PYTHONPATH`` (a test session, vLLM-Omni's
engine and worker processes) gets them before vLLM is imported:

- ``VLLM_TARGET_DEVICE=cpu`` (unless set): vLLM's platform is its ``CpuPlatform``;
- torchvision's ``nms``/``qnms`` op schemas (``demo/sglang/cpu_stand_ins/tvshim.py``, the one
  copy): the registry's torchvision for torch 2.13 is a CUDA build whose extension does not load;
- ``torchaudio`` and ``torchcodec`` hidden when their import fails (their CUDA builds raise
  OSError, which vLLM's optional imports do not catch): ``sys.modules[name] = None`` makes
  them an ImportError, which it does catch;
- `vo_cpu_platform`: vLLM-Omni has no CPU platform (cuda, rocm, npu, xpu, musa only). This
  folder's ``*.dist-info`` declares one in vLLM-Omni's ``vllm_omni.platform_plugins`` entry-point
  group (its supported route for an out-of-tree platform), so vLLM-Omni itself picks it; and
  two CPU fixes applied when vLLM-Omni's modules load (`vo_cpu_platform.install_fixes`).

docs/vllm_omni.md ("On a CPU") describes each. A GPU machine never loads this folder unless
someone puts it on ``PYTHONPATH``.
"""

import importlib
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_SGLANG_STAND_INS = os.path.join(os.path.dirname(os.path.dirname(_HERE)), "sglang", "cpu_stand_ins")
for _path in (_HERE, _SGLANG_STAND_INS):
    if _path not in sys.path:
        sys.path.append(_path)

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import tvshim  # noqa: E402

tvshim.install()

for _name in ("torchaudio", "torchcodec"):
    if _name not in sys.modules and importlib.util.find_spec(_name) is not None:
        try:
            importlib.import_module(_name)
        except (OSError, ImportError, RuntimeError):
            sys.modules[_name] = None  # type: ignore[assignment]

import vo_cpu_platform  # noqa: E402

vo_cpu_platform.install_fixes()
