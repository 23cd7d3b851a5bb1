"""FP8 (e4m3) KV codec: the format FP8 KV caches serve, a scale per token and head (or block).

Format of a segment ``x [B, H, S, D]`` (`TensorRecord` parts):

- ``values [B, H, S, D]`` float8_e4m3fn: ``e4m3(x / scale)`` (round to nearest even, the
  quotient clamped to e4m3's largest finite value 448);
- ``scales [B, H, S, G]`` float32, ``G = 1`` (a scale per token and head, the default) or
  ``G = D / block`` (a scale per ``block`` channels of a token): ``scale = amax / 448`` over
  the group, 0 for an all-zero group (its values decode to 0).

Decode: ``values * scale``. Bytes: ``B*H*S*D`` (values) ``+ 4*B*H*S*G`` (scales), so
``8 + 32 * G / D`` bits per element (8.25 at ``D = 128``, one scale per token and head).

Error bound (from e4m3's 3 mantissa bits): every element satisfies
``|x_hat - x| <= 2**-4 * |x| + 2**-10 * scale`` (half a unit in the last place of a normal
e4m3 value, ``2**-4`` relative; half the subnormal step ``2**-9`` below ``2**-6``), up to
float32 rounding of the division and product (relative ``2**-23``).
"""

from __future__ import annotations

from typing import Any

import torch

from causalkv.caches.codecs.base import (
    CodecError,
    KVCodec,
    TensorRecord,
    register_record,
)
from causalkv.errors import is_int

__all__ = ["E4M3_MAX", "FP8Codec", "FP8Record"]

E4M3_MAX = 448.0


class FP8Record(TensorRecord):
    """An FP8-packed segment: parts ``values`` ``[B, H, S, D]`` e4m3 and ``scales``
    ``[B, H, S, G]`` float32 (module docstring)."""


def _decode_into(record: FP8Record, out: torch.Tensor) -> None:
    values, scales = record.parts["values"], record.parts["scales"]
    x = values.float().unflatten(-1, (scales.shape[-1], -1)) * scales.unsqueeze(-1)
    out.copy_(x.flatten(-2))


register_record(FP8Record, decode_into=_decode_into)


class FP8Codec(KVCodec):
    """e4m3 values with a float32 scale per token and head (``block=None``) or per
    ``block`` channels of a token.

    Raises (`encode`): `CodecError` for a bad shape or dtype, ``D % block != 0``, or NaN/inf
    in ``x`` on the CPU (elsewhere a non-finite group decodes to non-finite values).
    """

    name = "fp8"

    def __init__(self, block: int | None = None) -> None:
        if block is not None and not is_int(block):
            raise CodecError(f"fp8 block must be a positive int or None, got {block!r}")
        self.block = block

    @classmethod
    def from_settings(cls, settings: Any, *, block: int | None = None, **_: Any) -> FP8Codec:
        """``block`` from the registered setting (None: a scale per token and head)."""
        return cls(block)

    def _groups(self, D: int) -> int:
        return 1 if self.block is None else D // self.block

    def layout_problem(self, head_dim: int) -> str | None:
        if self.block is not None and head_dim % self.block:
            return f"fp8 block {self.block} does not divide head_dim={head_dim}"
        return None

    def encode(
        self, x: torch.Tensor, *, seed: int = 1234, head_offset: int = 0,
        codebooks: list[torch.Tensor] | None = None,
    ) -> FP8Record:
        self.check_encode(x)
        xf = x.float().unflatten(-1, (self._groups(x.shape[-1]), -1))
        scale = xf.abs().amax(dim=-1) / E4M3_MAX  # [B, H, S, G]
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        v = (xf / safe.unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX)
        values = v.to(torch.float8_e4m3fn).flatten(-2)
        return FP8Record(tuple(x.shape), x.dtype, {"values": values, "scales": scale.contiguous()})

    def decode_into(self, record: FP8Record, out: torch.Tensor) -> None:  # type: ignore[override]
        self.check_out(record, out)
        _decode_into(record, out)

    def nbytes(self, shape: tuple[int, int, int, int]) -> int:
        B, H, S, D = (int(v) for v in shape)
        return B * H * S * D + 4 * B * H * S * self._groups(D)

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """The module docstring's bound per element: ``2**-4 * |x| + 2**-10 * scale`` with
        ``scale = amax / 448`` of the element's group, plus float32 rounding (``2**-22 * |x|``
        covers the division and the product)."""
        xd = x.detach().double().unflatten(-1, (self._groups(x.shape[-1]), -1))
        scale = xd.abs().amax(dim=-1, keepdim=True) / E4M3_MAX
        bound = (2.0**-4 + 2.0**-22) * xd.abs() + 2.0**-10 * scale
        return bound.flatten(-2)
