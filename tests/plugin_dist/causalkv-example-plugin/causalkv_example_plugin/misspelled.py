"""A plugin that fails validation: its hook name matches no causalkv hookspec."""

from causalkv.hooks import hookimpl


@hookimpl
def causalkv_register_stage():  # typo: the hook is causalkv_register_stages
    return []
