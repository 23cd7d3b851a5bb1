"""A plugin whose host-class registration raises: it is set aside, every other plugin is served."""

from causalkv.hooks import hookimpl


@hookimpl
def causalkv_register_host_classes():
    raise RuntimeError("the host-class registration fails on purpose")
