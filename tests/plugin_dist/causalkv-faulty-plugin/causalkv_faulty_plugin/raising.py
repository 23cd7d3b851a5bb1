"""A plugin whose registration hook raises: it is set aside, every other plugin keeps working."""

from causalkv.hooks import hookimpl


@hookimpl
def causalkv_register_stages():
    raise RuntimeError("the registration hook fails on purpose")
