"""The test plugin distributions of ``tests/plugin_dist``, pip-installed the way a user installs
a plugin (no network): `install` builds one from a copy (pip's in-tree build would leave
``build/`` and ``*.egg-info`` in tests/) into a ``--target`` folder, which a subprocess then
puts on its PYTHONPATH (`environment`), or this process puts on ``sys.path``
(`found_in_process`), so discovery goes through importlib.metadata exactly as for an installed
plugin."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
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


#: `run_commands`' one interpreter: imports the modules it is given (never a plugin's: the
#: children discover those), then forks a child per command line, each with its environment,
#: its argv, and stdout and stderr in files of their own; the child runs ``python -m MODULE
#: ARGS`` or ``python -c CODE ARGS`` as the interpreter would, flushes both streams and leaves
#: with ``os._exit`` (tearing torch down would take seconds).
DRIVER = r"""
import importlib, json, os, runpy, sys, tempfile, traceback
spec = json.load(open(sys.argv[1]))
for name in spec["preload"]:
    importlib.import_module(name)
site = spec["site"]
assert not [m for m in list(sys.modules.values())
            if str(getattr(m, "__file__", None) or "").startswith(site)], "a plugin imported before the fork"


def child(argv, env):
    os.environ.clear()
    os.environ.update(env)
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            assert argv[0] == "-c", argv
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        code = 0
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()
        code = 1
    if not isinstance(code, int):
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


results = []
for argv, env in spec["commands"]:
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        child(argv, env)
    _, status = os.waitpid(pid, 0)
    out.seek(0)
    err.seek(0)
    results.append([os.waitstatus_to_exitcode(status), out.read().decode(), err.read().decode()])
with open(sys.argv[2], "w") as f:
    json.dump(results, f)
"""


@dataclass(frozen=True)
class Command:
    """One command line of `run_commands`: ``python ARGV`` with `environment`'s variables
    plus ``env``."""

    argv: Sequence[str]
    env: dict[str, str] | None = None


def run_commands(site: Path, commands: Sequence[Command], *paths: Path, preload: Sequence[str] = (),
                 cwd: Path | None = None, timeout: int = 600,
                 **env_vars: str) -> list[subprocess.CompletedProcess]:
    """Each command as ``python ARGV`` in a fresh interpreter would run it, with
    ``environment(site, *paths, **env_vars)`` and its own ``env`` on top: one interpreter (whose
    ``sys.path`` is that environment's) imports ``preload`` (torch, causalkv's command line: seconds)
    once and forks a child per command, in which the plugins are discovered, from
    importlib.metadata, as in a fresh interpreter. The commands run one after another, in
    ``cwd``; each answer has its ``returncode``, ``stdout`` and ``stderr``."""
    base = environment(site, *paths, **env_vars)
    spec = {"site": str(site), "preload": list(preload),
            "commands": [[list(c.argv), {**base, **(c.env or {})}] for c in commands]}
    tmp = site.parent / "commands"
    tmp.mkdir(exist_ok=True)
    (tmp / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(tmp / "spec.json"), str(tmp / "results.json")],
                          capture_output=True, text=True, timeout=timeout, env=base, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp / "results.json").read_text())
    return [subprocess.CompletedProcess([sys.executable, *c.argv], code, out, err)
            for c, (code, out, err) in zip(commands, results, strict=True)]
