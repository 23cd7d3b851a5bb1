"""Placeholder: replaced by the runtime issue."""


def register(subparsers):
    return None
