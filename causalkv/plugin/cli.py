"""Placeholder: replaced by the plugin issue."""


def register(subparsers):
    return None
