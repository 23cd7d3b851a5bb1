"""Re-export of `causalkv.cli.plugins` (the command line lives in `causalkv.cli`)."""

from causalkv.cli.plugins import plugins_report, register, run_plugins, run_resolve

__all__ = ["plugins_report", "register", "run_plugins", "run_resolve"]
