"""The registrations (names only: nothing of sglang or vLLM-Omni is imported here; each
host's bridge imports its class)."""

from causalkv.hooks import HostRegistration, hookimpl


@hookimpl
def causalkv_register_host_classes():
    return [
        HostRegistration("sglang", "causalkv_host_plugin.sglang_stage:ToyLongLive2Stage",
                         models="ToyLongLive2Pipeline", codec="int8"),
        HostRegistration("vllm-omni", "causalkv_host_plugin.vllm_omni_pipeline:ToyLingBotWorldPipeline",
                         models="ToyLingBotWorldPipeline", codec="int8"),
    ]
