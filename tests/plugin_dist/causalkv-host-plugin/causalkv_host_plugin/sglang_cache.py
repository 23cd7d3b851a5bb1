"""A cache kind of sglang's (imports sglang): built with sglang's allocation keywords."""

from causalkv.sglang.cache import SGLangQVGKVCache


class ToySGLangCache(SGLangQVGKVCache):
    """The bridge's sglang cache under another name: every method inherited."""
