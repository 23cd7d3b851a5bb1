"""CPU stand-in: reference CPU implementations of the two ``sgl_kernel`` ops that sglang's
diffusion runtime calls on a CPU (installed by this folder's ``sitecustomize``).

sglang 0.5.23's CPU platform dispatches its fused norm layers (``LayerNormScaleShift``,
``ScaleResidualLayerNormScaleShift`` and their RMS twins, ``runtime/layers/layernorm.py``)
to ``torch.ops.sgl_kernel.fused_norm_scale_shift_cpu`` and
``torch.ops.sgl_kernel.fused_scale_residual_norm_scale_shift_cpu``. They live in sglang's
kernel wheel, whose registry builds are for GPUs, so on this machine the ops do not exist and
every Wan block fails. `install()` defines them, in this process only and only when they are
missing (an installed kernel wheel that has them wins), as plain PyTorch: the same arithmetic
as sglang's own ``forward_native`` (norm in float32, cast back, ``* (1 + scale) + shift``; the
residual variant first adds ``x * gate`` to the residual and also returns the sum).
``tests/sglang_bridge/test_e2e_settings.py`` (``test_cpu_norm_ops_match_sglangs_forward_native``)
checks them against ``forward_native``. Not part of the causalkv distribution.
"""

from __future__ import annotations

_LIBS: list[object] = []

_SCHEMAS = {
    "fused_norm_scale_shift_cpu": (
        "fused_norm_scale_shift_cpu(Tensor x, Tensor? weight, Tensor? bias, Tensor scale, "
        "Tensor shift, str norm_type, float eps) -> Tensor"
    ),
    "fused_scale_residual_norm_scale_shift_cpu": (
        "fused_scale_residual_norm_scale_shift_cpu(Tensor residual, Tensor x, Tensor? gate, "
        "Tensor? weight, Tensor? bias, Tensor scale, Tensor shift, str norm_type, float eps) "
        "-> (Tensor, Tensor)"
    ),
}


def _norm(x, weight, bias, norm_type: str, eps: float):
    """sglang's ``FP32LayerNorm`` / ``RMSNorm`` forward_native: float32 math, x's dtype out."""
    import torch
    import torch.nn.functional as F

    if norm_type == "layer":
        w = None if weight is None else weight.float()
        b = None if bias is None else bias.float()
        return F.layer_norm(x.float(), (x.shape[-1],), w, b, eps).to(x.dtype)
    if norm_type == "rms":
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
        return (xf if weight is None else xf * weight).to(x.dtype)
    raise ValueError(f"norm_type must be 'layer' or 'rms', got {norm_type!r}")


def fused_norm_scale_shift(x, weight, bias, scale, shift, norm_type: str, eps: float):
    """``norm(x) * (1 + scale) + shift`` in x's dtype; scale/shift already ``[B, L, C]``."""
    return (_norm(x, weight, bias, norm_type, eps) * (1 + scale) + shift).to(x.dtype)


def fused_scale_residual_norm_scale_shift(
    residual, x, gate, weight, bias, scale, shift, norm_type: str, eps: float
):
    """``r = residual + x * gate`` (``gate`` None: ``+ x``); ``(norm(r) * (1 + scale) + shift, r)``."""
    summed = residual + (x if gate is None else x * gate)
    return _norm(summed, weight, bias, norm_type, eps) * (1 + scale) + shift, summed


def _op_exists(name: str) -> bool:
    import torch

    try:
        getattr(torch.ops.sgl_kernel, name)
        return True
    except (AttributeError, RuntimeError):
        return False


def install() -> bool:
    """Define the missing ops with CPU kernels; True when it defined any."""
    if _LIBS:
        return True
    import torch

    impls = {
        "fused_norm_scale_shift_cpu": fused_norm_scale_shift,
        "fused_scale_residual_norm_scale_shift_cpu": fused_scale_residual_norm_scale_shift,
    }
    missing = [name for name in _SCHEMAS if not _op_exists(name)]
    if not missing:
        return False
    lib = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name in missing:
        lib.define(_SCHEMAS[name])
        lib.impl(name, impls[name], "CPU")
    _LIBS.append(lib)
    return True
