"""Per-thread reusable CPU temporaries for the codec (the driver and the PyTorch backend).

A fresh multi-MB allocation on the CPU costs a page fault per 4 KiB, more than the work done
in it, so the codec's large temporaries (tile-sized, at most a few MB each) live in buffers
kept per thread and reused across calls. Off the CPU every call allocates (the caching
allocator already reuses memory there).
"""

from __future__ import annotations

import threading

import torch

__all__ = ["WORKSPACE", "temporary"]

#: per-thread buffers: ``WORKSPACE.bufs`` maps ``(name, dtype)`` to a 1-D tensor
WORKSPACE = threading.local()


def temporary(name: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D ``[n]`` temporary. On the CPU it is kept per thread under ``(name, dtype)`` and
    reused across calls (so two temporaries live at once need two names); its contents are
    whatever the last user left."""
    if device.type != "cpu":
        return torch.empty(n, dtype=dtype, device=device)
    bufs = WORKSPACE.__dict__.setdefault("bufs", {})
    buf = bufs.get((name, dtype))
    if buf is None or buf.numel() < n:
        buf = bufs[(name, dtype)] = torch.empty(n, dtype=dtype)
    return buf[:n]
