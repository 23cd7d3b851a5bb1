"""The test plugin distributions of ``tests/plugin_dist``, pip-installed the way a user installs
a plugin (no network): `install` builds one from a copy (pip's in-tree build would leave
``build/`` and ``*.egg-info`` in tests/) into a ``--target`` folder, which a subprocess then
puts on its PYTHONPATH (`environment`), or this process puts on ``sys.path``
(`found_in_process`), so discovery goes through importlib.metadata exactly as for an installed
plugin."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent

#: distribution -> the modules of tests/ it ships (copied into the build's copy, so a module a
#: test also imports in-process has one source)
SHARED_MODULES = {"causalkv-codec-plugin": ("toy_codec_plugin.py",),
                  "causalkv-host-plugin": ("toy_codec_plugin.py",)}


def install(name: str, root: Path) -> Path:
    """Install ``tests/plugin_dist/<name>`` (with its `SHARED_MODULES`) into ``root/site``;
    that folder."""
    src = root / "src"
    shutil.copytree(HERE / "plugin_dist" / name, src,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    for module in SHARED_MODULES.get(name, ()):
        shutil.copy(HERE / module, src / module)
    target = root / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--disable-pip-version-check", "--target", str(target), str(src)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    return target


def environment(site: Path, *paths: Path, **env_vars: str) -> dict[str, str]:
    """This process's environment without ``CAUSALKV_*`` settings, with ``site`` (then
    ``paths``) first on PYTHONPATH, and ``env_vars``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAUSALKV_")}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(site), *map(str, paths), *filter(None, [env.get("PYTHONPATH")])])
    env.update(env_vars)
    return env


@contextmanager
def found_in_process(site: Path, monkeypatch: Any) -> Iterator[None]:
    """``site``'s distributions found by this process's plugin discovery, as if installed here:
    ``site`` first on ``sys.path``, no ``CAUSALKV_*`` variable, a fresh process-wide plugin
    manager. On exit the manager is rebuilt again, the modules imported from ``site`` are
    forgotten and (``monkeypatch``) causalkv's codec registry and the environment restored."""
    from causalkv.caches import codecs
    from causalkv.plugin.manager import reset_plugin_manager

    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(codecs, "_SETTINGS", dict(codecs._SETTINGS))
    for var in [v for v in os.environ if v.startswith("CAUSALKV_")]:
        monkeypatch.delenv(var)
    reset_plugin_manager()
    try:
        yield
    finally:
        reset_plugin_manager()
        for name, module in list(sys.modules.items()):
            if str(getattr(module, "__file__", None) or "").startswith(str(site)):
                del sys.modules[name]
