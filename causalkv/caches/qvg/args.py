"""Re-export of `causalkv.caches.qvg.options` (the QVG settings, torch-free)."""

from causalkv.caches.qvg.options import QUANT_CHOICES, QVGKVQuantArgs, add_cli_args, from_namespace

__all__ = ["QUANT_CHOICES", "QVGKVQuantArgs", "add_cli_args", "from_namespace"]
