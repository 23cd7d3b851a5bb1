"""The one name and the pluggy markers derived from it.

``NAME`` drives the hook markers, the entry-point group and the env var prefix
(``CAUSALKV_PLUGINS``, ``CAUSALKV_DISABLE_PLUGINS``, ...).
"""

from __future__ import annotations

import pluggy

__all__ = ["NAME", "ENV_PREFIX", "ENTRY_POINT_GROUP", "hookspec", "hookimpl"]

#: project name: pluggy project name, entry-point group, env var prefix
NAME = "causalkv"
#: entry-point group third-party distributions declare their plugins under
ENTRY_POINT_GROUP = NAME
#: prefix of the env vars that control plugin loading
ENV_PREFIX = NAME.upper()

#: marks a hook specification (used by `causalkv.hooks.specs` only)
hookspec = pluggy.HookspecMarker(NAME)
#: marks a hook implementation in a plugin: ``@hookimpl def causalkv_register_stages(): ...``
hookimpl = pluggy.HookimplMarker(NAME)
