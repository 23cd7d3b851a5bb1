"""NVFP4 KV codec: e2m1 values, an e4m3 scale per 16 elements, an fp32 scale per tensor.

Format of a segment ``x [B, H, S, D]`` (`TensorRecord`):

- ``global_scale`` (whole record) float32 ``g = amax(|x|) / (448 * 6)``: the tensor's
  largest block then has the e4m3 scale 448;
- ``scales [B, H, S, D / 16]`` float8_e4m3fn (parts): per block of 16 channels of a token,
  ``e4m3(bmax / (6 * g))`` (round to nearest even), ``bmax`` the block's largest ``|x|``;
  the decoded block scale is ``s = scales * g``;
- ``codes [B, H, S, D / 2]`` uint8 (parts): two 4-bit e2m1 codes per byte (channel ``2i`` in
  the low nibble), each a sign bit (bit 3) and an index (bits 0-2) into the e2m1 magnitudes
  ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``: ``x / s`` rounded to the nearest magnitude (ties to the
  even index), saturated at 6. A block with ``s = 0`` decodes to zeros.

Decode: ``sign * E2M1[index] * s``. Bytes: ``B*H*S*D/2 + B*H*S*D/16 + 4``, so
``4.5 + 32 / (B*H*S*D)`` bits per element.

Error bound: in a block whose scale is a normal e4m3 value (``bmax >= amax / 28672``),
``|x_hat - x| <= bmax / 4`` (half the widest e2m1 step, 1, times ``s``, plus saturation after
the scale's rounding down by at most ``2**-4``: ``1.4 * s <= 1.4 * 1.0625 * bmax / 6``); in
any other block ``|x_hat - x| <= amax / 14336``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from causalkv.caches.codecs.base import (
    KVCodec,
    TensorRecord,
    register_record,
)

__all__ = ["BLOCK", "E2M1", "NVFP4Codec", "NVFP4Record"]

BLOCK = 16
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E4M3_MAX = 448.0
_MIDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@functools.lru_cache(maxsize=8)
def _table(device: torch.device) -> torch.Tensor:
    """Decoded value of each 4-bit code ``[16]`` float32 (index | sign << 3)."""
    mag = torch.tensor(E2M1, dtype=torch.float32)
    return torch.cat([mag, -mag]).to(device)


class NVFP4Record(TensorRecord):
    """An NVFP4-packed segment: parts ``codes`` ``[B, H, S, D/2]`` uint8 and ``scales``
    ``[B, H, S, D/16]`` e4m3, whole ``global_scale`` ``[]`` float32 (module docstring)."""


def _decode_into(record: NVFP4Record, out: torch.Tensor) -> None:
    codes, scales = record.parts["codes"], record.parts["scales"]
    table = _table(codes.device)
    vals = torch.stack([table[(codes & 0xF).long()], table[(codes >> 4).long()]], dim=-1)
    s = scales.float() * record.whole["global_scale"].to(codes.device)
    out.copy_((vals.flatten(-2).unflatten(-1, (-1, BLOCK)) * s.unsqueeze(-1)).flatten(-2))


register_record(NVFP4Record, decode_into=_decode_into)


class NVFP4Codec(KVCodec):
    """NVFP4 (LongLive 2.0's KV format): module docstring.

    Raises (`encode`): `CodecError` for a bad shape or dtype, ``D % 16 != 0``, or NaN/inf in
    ``x`` on the CPU.
    """

    name = "nvfp4"

    @classmethod
    def from_settings(cls, settings: Any, **_: Any) -> NVFP4Codec:
        return cls()

    def layout_problem(self, head_dim: int) -> str | None:
        if head_dim % BLOCK:
            return f"nvfp4 packs blocks of {BLOCK} channels; head_dim={head_dim} is not a multiple of {BLOCK}"
        return None

    def encode(
        self, x: torch.Tensor, *, seed: int = 1234, head_offset: int = 0,
        codebooks: list[torch.Tensor] | None = None,
    ) -> NVFP4Record:
        self.check_encode(x)
        xf = x.float().unflatten(-1, (-1, BLOCK))
        amax = xf.abs().amax() if xf.numel() else torch.zeros((), device=x.device)
        g = (amax / (_E4M3_MAX * 6.0)).float()
        g_safe = torch.where(g > 0, g, torch.ones_like(g))
        bmax = xf.abs().amax(dim=-1)  # [B, H, S, D/16]
        scales = (bmax / (6.0 * g_safe)).clamp_(max=_E4M3_MAX).to(torch.float8_e4m3fn)
        s = scales.float() * g_safe
        v = torch.where(s.unsqueeze(-1) > 0, xf / torch.where(s > 0, s, 1.0).unsqueeze(-1), 0.0)
        a = v.abs().clamp_(max=6.0)
        mids = torch.tensor(_MIDS, dtype=torch.float32, device=x.device)
        idx = (a.unsqueeze(-1) > mids).sum(-1)  # the lower index on a tie
        tie = (a.unsqueeze(-1) == mids).any(-1)
        idx = idx + (tie & (idx % 2 == 1))  # ties to the even index
        code = (idx | ((v < 0) & (idx > 0)).long() << 3).to(torch.uint8).flatten(-2)
        codes = code[..., 0::2] | (code[..., 1::2] << 4)
        return NVFP4Record(tuple(x.shape), x.dtype, {"codes": codes.contiguous(), "scales": scales},
                           {"global_scale": g.reshape(())})

    def decode_into(self, record: NVFP4Record, out: torch.Tensor) -> None:  # type: ignore[override]
        self.check_out(record, out)
        _decode_into(record, out)

    def nbytes(self, shape: tuple[int, int, int, int]) -> int:
        B, H, S, D = (int(v) for v in shape)
        n = B * H * S * D
        return n // 2 + n // BLOCK + 4

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """The module docstring's bound per element: ``bmax / 4`` in a block whose e4m3 scale
        is normal (``bmax >= amax / 28672``), ``amax / 14336`` in any other (the larger of
        the two is taken everywhere), plus float32 rounding (``2**-22 * |x|``)."""
        xd = x.detach().double().unflatten(-1, (-1, BLOCK))
        amax = xd.abs().amax() if xd.numel() else xd.new_zeros(())
        bmax = xd.abs().amax(dim=-1, keepdim=True)
        bound = torch.maximum(bmax / 4, amax / 14336) + 2.0**-22 * xd.abs()
        return bound.flatten(-2)
