"""A vLLM-Omni pipeline causalkv does not ship (imports vLLM-Omni): causalkv's LingBot-World
pipeline under another name, with LingBot-World's pre/post-process functions."""

from causalkv.vllm_omni.pipeline import (  # noqa: F401 - vLLM-Omni loads them from here
    CausalKVLingBotWorldPipeline,
    get_lingbot_world_post_process_func,
    get_lingbot_world_pre_process_func,
)


class ToyLingBotWorldPipeline(CausalKVLingBotWorldPipeline):
    """causalkv's LingBot-World pipeline under another name."""
