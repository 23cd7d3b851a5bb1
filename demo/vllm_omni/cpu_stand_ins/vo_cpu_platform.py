"""CPU stand-in: vLLM-Omni's platform plugin for a CPU, and two CPU fixes of vLLM-Omni 0.30.0.

Light to import (no vLLM): `activate` is the ``vllm_omni.platform_plugins`` entry point
(declared by this folder's ``*.dist-info``) and returns the class in `vo_cpu_omni_platform`,
which vLLM-Omni then imports. `install_fixes` patches two vLLM-Omni modules as they load (an
import hook; nothing is loaded early):

- ``SDPAImpl.forward``: vLLM-Omni's attention dispatcher knows cuda/hip/npu/xpu/musa only and
  raises on any other platform; on the CPU platform it calls the backend's own
  ``_forward_impl`` (torch SDPA, the mask mode its CUDA path uses).
- ``RotaryEmbeddingWan.forward_native``: the non-CUDA path multiplies ``(B, S, H, D/2)`` halves
  by ``(S, D/2)`` cos/sin tables, which do not broadcast (an upstream bug on every non-CUDA
  device); the tables get a head axis, the arithmetic is unchanged.

Not part of the causalkv distribution; docs/vllm_omni.md ("On a CPU").
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

#: module -> the function that patches it once it has loaded
_FIXES: dict[str, str] = {
    "vllm_omni.diffusion.attention.backends.sdpa": "_fix_sdpa",
    "vllm_omni.diffusion.layers.rope": "_fix_rope",
}
_INSTALLED: list[object] = []


def activate() -> str:
    """``vllm_omni.platform_plugins`` entry point: the CPU platform's qualified name."""
    return "vo_cpu_omni_platform.CPUOmniPlatform"


def _fix_sdpa(module) -> None:
    impl = module.SDPAImpl

    def forward(self, query, key, value, attn_metadata=None):
        return self._forward_impl(query, key, value, attn_metadata, mask_mode="broadcast_k")

    impl.forward = forward


def _fix_rope(module) -> None:
    cls = module.RotaryEmbeddingWan
    native = cls.forward_native

    def forward_native(self, x, cos, sin):
        if x.dim() == 4 and cos.dim() == 2:  # (S, D/2) tables against (B, S, H, D/2) halves
            cos, sin = cos[:, None, :], sin[:, None, :]
        return native(self, x, cos, sin)

    cls.forward_native = forward_native


class _Loader(importlib.abc.Loader):
    def __init__(self, loader, fix: str) -> None:
        self._loader, self._fix = loader, fix

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        globals()[self._fix](module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        fix = _FIXES.get(name)
        if fix is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, fix)
        return spec


def install_fixes() -> None:
    """Patch the two modules when they load (now, if they already have)."""
    if _INSTALLED:
        return
    for name, fix in _FIXES.items():
        if name in sys.modules:
            globals()[fix](sys.modules[name])
    finder = _Finder()
    sys.meta_path.insert(0, finder)
    _INSTALLED.append(finder)
