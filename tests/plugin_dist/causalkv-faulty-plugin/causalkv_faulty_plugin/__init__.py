"""Two causalkv plugins that fail on purpose (``raising``, ``seedflag``)."""
