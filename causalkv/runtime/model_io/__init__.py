"""The model's files and components: reading a model folder or a preset's config
(`model_config`, `preset_configs`; `geometry`: the memory planner's view of it), building the
tiny presets (`presets`), loading the components with diffusers / transformers
(`components`), the causal attention processors of diffusers' Wan transformer (`causal_wan`)
and the UMT5 prompt encoder (`prompt_encoding`).

Below the host and the files; imports only `causalkv.runtime.processes` of the runtime.
"""
