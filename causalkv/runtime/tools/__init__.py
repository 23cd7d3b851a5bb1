"""Tools beside the host: tiny checkpoints in sglang's own format (`sglang_checkpoints`,
``causalkv sglang-checkpoint``). They use the model I/O and the files, never the host.
"""
