"""Placeholder."""


def register(subparsers):
    return None
