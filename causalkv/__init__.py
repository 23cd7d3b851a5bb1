"""causalkv: causal KV caches and a plugin-driven host for chunk-by-chunk video diffusion."""
__version__ = "0.1.0"
