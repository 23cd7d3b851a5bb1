"""Re-export of `causalkv.cli.generate` (the command line lives in `causalkv.cli`)."""

from causalkv.cli.generate import add_generate_args, options_from_args, register, run_generate

__all__ = ["add_generate_args", "options_from_args", "register", "run_generate"]
