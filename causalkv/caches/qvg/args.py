"""Re-export of `causalkv.quant_config` (the QVG settings live in a torch-free module)."""

from causalkv.quant_config import QUANT_CHOICES, QVGKVQuantArgs, add_cli_args, from_namespace

__all__ = ["QUANT_CHOICES", "QVGKVQuantArgs", "add_cli_args", "from_namespace"]
