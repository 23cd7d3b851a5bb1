"""Compatibility: the QVG settings' old home. `QVGKVQuantArgs` lives in
`causalkv.caches.qvg.options` (its codec and packing parts, declared once); this module and
``causalkv.caches.qvg.args`` re-export it with the reference runtime's CLI helpers. Torch-free.
"""

from causalkv.caches.qvg.options import (
    QUANT_CHOICES,
    QVGCodecOptions,
    QVGKVQuantArgs,
    QVGPackingOptions,
    add_cli_args,
    from_namespace,
)

__all__ = [
    "QUANT_CHOICES",
    "QVGCodecOptions",
    "QVGKVQuantArgs",
    "QVGPackingOptions",
    "add_cli_args",
    "from_namespace",
]
