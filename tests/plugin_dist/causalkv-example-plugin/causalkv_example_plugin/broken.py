"""A plugin whose import fails: causalkv must report it and load the others."""

raise ImportError("causalkv_example_plugin.broken fails to import on purpose")
