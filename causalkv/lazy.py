"""A package's names imported on first use: the one module ``__getattr__`` the packages share.

    from causalkv.lazy import lazy_names

    __getattr__ = lazy_names(__name__, {"generate": "causalkv.runtime.host.generate"})

Each name is looked up in its home module when it is first read (PEP 562), so importing the
package imports none of its homes (``causalkv.runtime`` and ``causalkv.stages`` import no
torch until a name that needs it is read). A leaf: imports nothing of causalkv, no torch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``homes`` maps each name to the module it is
    imported from on first use (then kept on the package, so later reads skip the import);
    any other name raises the usual `AttributeError`."""

    def __getattr__(name: str) -> Any:
        if (home := homes.get(name)) is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(home), name)
        if (module := sys.modules.get(package)) is not None:  # kept: the next read is a plain attribute, no call
            setattr(module, name, value)
        return value

    return __getattr__
