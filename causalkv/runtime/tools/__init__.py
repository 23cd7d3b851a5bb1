"""Tools beside the host: tiny checkpoints in sglang's and vLLM-Omni's own formats
(`checkpoints`, ``causalkv sglang-checkpoint`` and ``vllm-omni-checkpoint``). They use the model I/O and the files, never the host.
"""
