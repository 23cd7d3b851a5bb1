"""CPU stand-in: let a CUDA-built torchvision import on a CPU-only torch (installed by this
folder's ``sitecustomize``).

The registry's torchvision wheel for torch 2.13 is a CUDA build: its ``_C`` extension does
not load on the CPU torch, and ``torchvision/_meta_registrations.py`` then registers fake
kernels for ``torchvision::nms`` and ``torchvision::qnms`` without checking that the ops
exist, so ``import torchvision`` raises. sglang imports torchvision at import time (its
multimodal helpers), though nothing the CPU demo or the bridge tests run calls a torchvision
op.

`install()` defines the schemas of those two ops (no kernels) only when torchvision is
installed and its extension does not load, before torchvision is imported. It touches no
file; it lives in this process only and is undone by not calling it. Not part of the causalkv
distribution.
"""

from __future__ import annotations

import importlib.util
import os

_LIBS: list[object] = []
_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}


def install() -> bool:
    """Define the missing torchvision op schemas if needed; True when it did."""
    if _LIBS:
        return True
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    import torch

    so = os.path.join(next(iter(spec.submodule_search_locations)), "_C.so")
    try:
        torch.ops.load_library(so)
        return False  # a working extension defines the ops itself
    except (OSError, RuntimeError):
        pass
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for name, schema in _SCHEMAS.items():
        if not _op_exists(name):
            lib.define(schema)
    _LIBS.append(lib)
    return True


def _op_exists(name: str) -> bool:
    import torch

    try:
        getattr(torch.ops.torchvision, name)
        return True
    except (AttributeError, RuntimeError):
        return False
