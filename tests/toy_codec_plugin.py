"""A whole KV codec in one plugin module (docs/plugins.md, "A codec"): int8 with a float32
scale per token and head. `tests/test_codec_plugin.py` registers this module as a plugin."""

from __future__ import annotations

from typing import Any

import torch

from causalkv.caches.codecs.base import KVCodec, TensorRecord, check_segment, register_record
from causalkv.hooks import CodecRegistration, hookimpl


class Int8Record(TensorRecord):
    """``values [B, H, S, D]`` int8 and ``scales [B, H, S, 1]`` float32."""


def _decode_into(record: Int8Record, out: torch.Tensor) -> None:
    out.copy_(record.parts["values"].float() * record.parts["scales"])


register_record(Int8Record, decode_into=_decode_into)


class Int8Codec(KVCodec):
    """Symmetric int8, ``scale = amax / 127`` per token and head."""

    name = "int8"

    @classmethod
    def from_settings(cls, settings: Any, **params: Any) -> Int8Codec:
        return cls()

    def encode(self, x, *, seed=1234, head_offset=0, codebooks=None) -> Int8Record:
        check_segment(self.name, x)
        xf = x.float()
        scale = xf.abs().amax(-1, keepdim=True) / 127.0
        values = torch.round(xf / torch.where(scale > 0, scale, 1.0)).to(torch.int8)
        return Int8Record(tuple(x.shape), x.dtype, {"values": values, "scales": scale})

    def decode_into(self, record, out) -> None:
        self.check_out(record, out)
        _decode_into(record, out)

    def nbytes(self, shape) -> int:
        B, H, S, D = shape
        return B * H * S * D + 4 * B * H * S

    def error_bound(self, x):
        """Half a step of the token's grid (``amax / 127``), plus float32 rounding."""
        return x.double().abs().amax(-1, keepdim=True).expand(x.shape) * (0.5 + 2**-16) / 127


class WritesZeros(Int8Codec):
    """A broken variant (registered by no hook: the tests name it ``toy_codec_plugin:WritesZeros``):
    it decodes zeros, which the conformance check's error bound refuses."""

    def decode_into(self, record, out) -> None:
        self.check_out(record, out)
        out.zero_()


@hookimpl
def causalkv_register_codecs():
    return [CodecRegistration("int8", "toy_codec_plugin:Int8Codec",
                              help="int8 with a float32 scale per token and head (a toy)")]
