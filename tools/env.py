#!/usr/bin/env python3
"""Build or reuse causalkv's Python environments, one per job (``make venv``, ``make test``).

    python3 tools/env.py main .venv                  # causalkv + its test extra
    python3 tools/env.py sglang .venv-sglang         # + the released sglang 0.5.23's import set
    python3 tools/env.py vllm-omni .venv-vllm-omni   # + vLLM-Omni 0.30.0 and vllm 0.30.0
    python3 tools/env.py bench .venv-bench           # main + the benchmarks' peers (`make bench`)

Two kinds of environment, so that third-party packages are installed once per machine while
every checkout runs its own code:

- **Layers**, cached outside the checkout (``$CAUSALKV_ENV_CACHE``, else
  ``$XDG_CACHE_HOME/causalkv/envs``, else ``~/.cache/causalkv/envs``), hold third-party packages
  only, never causalkv. A layer's folder is named by a hash of what goes into it (the Python
  version, its pip commands, the text of the requirement files they read, the layers below
  it), so it is built once and reused by every clone until its pins change; a change gives a new
  folder and leaves the old one to the clones that still ask for it. The torch layer
  (``torch==2.13.0``, the CPU build on this machine's disk) lies under the other three, so torch
  is installed once. A layer sees the layers below it through a ``.pth`` file of its
  ``site-packages`` (``site.addsitedir``), as a venv sees its base's packages. A build holds a
  lock (two clones building the same layer wait for each other) and is marked complete only at
  its end: a failed build is removed, never reused. What a layer installs is first fetched into
  the machine's wheelhouse (``<cache>/wheels``), which pip never downloads a file into twice,
  and installed from there: a changed pin downloads that one package, not the layer.
- **The checkout's environment** (``.venv``, ``.venv-sglang``, ``.venv-vllm-omni`` in the
  checkout) is a venv of its own that sees one layer and holds causalkv from this checkout
  (editable, with its entry points) and a copy of the layer's console scripts (``pytest``,
  ``sglang``, ``lint-imports``...) that run its own interpreter. It is made in seconds, and
  remade when its layer or ``pyproject.toml`` changes. Two clones share layers and nothing else:
  each one imports its own ``causalkv``, and deleting one breaks nothing in the other
  (``tests/test_envs.py`` proves it).

Each call prints one line: what it built or reused, and the seconds it took.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQ = ROOT / "requirements"
#: the ``.pth`` a layer or a checkout's environment reaches the layer below it through
LAYER_PTH = "_causalkv_layers.pth"
#: marks a complete layer (written last) and a checkout's environment (what it was made from)
DONE = ".causalkv-layer.json"
CHECKOUT = ".causalkv-env.json"
#: what every layer's pip install starts from: torch pinned (the CPU build on disk; any other
#: spelling pulls a CUDA build), and what an editable install of causalkv builds with
#: (``--no-build-isolation``: nothing downloaded per clone)
TORCH = ("torch==2.13.0",)
BUILD = ("setuptools>=77", "wheel")


@dataclass(frozen=True)
class Layer:
    """A cached layer: ``steps`` are ``pip install`` argument lists run in order; ``below``
    names the layer it stands on."""

    name: str
    steps: tuple[tuple[str, ...], ...]
    below: str | None = None
    #: fetch what the steps install into the machine's wheelhouse first, install from there
    wheelhouse: bool = True


def _pyproject() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: pip vendors the same parser
        from pip._vendor import tomli as tomllib  # type: ignore[no-redef]
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _requirements(*extras: str) -> tuple[str, ...]:
    """The requirements of causalkv's ``extras``, as pyproject.toml declares them."""
    project = _pyproject()["project"]
    extra = project["optional-dependencies"]
    return tuple(req for name in extras for req in extra[name])


LAYERS = {
    # torch from this machine's disk; pip and the build backend are small
    "torch": Layer("torch", (("--upgrade", "pip"), TORCH, BUILD), wheelhouse=False),
    "main": Layer("main", ((*_pyproject()["project"]["dependencies"], *_requirements("test")),),
                  below="torch"),
    # the benchmarks' peer quantizers (extra `bench`), apart from the suite's packages: torchao
    # makes diffusers warn at every load, which the command line's one-line-stderr tests see
    "bench": Layer("bench", (_requirements("bench"),), below="main"),
    # sglang==0.5.23 declares GPU-only requirements: its import set is pinned, without deps
    "sglang": Layer("sglang", (("--no-deps", "-r", str(REQ / "sglang.txt")),), below="torch"),
    "vllm-omni": Layer("vllm-omni", (("-r", str(REQ / "vllm-omni.txt")),), below="torch"),
}


def cache_dir() -> Path:
    explicit = os.environ.get("CAUSALKV_ENV_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "causalkv" / "envs"


def _pins(path: Path) -> list[str]:
    """A requirement file's requirements (comments and blank lines are no part of the key)."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def _step_text(step: tuple[str, ...]) -> list:
    """A step with each requirement file it reads replaced by its pins (they are the key)."""
    return [_pins(Path(arg)) if i and step[i - 1] == "-r" else arg for i, arg in enumerate(step)]


def layer_key(layer: Layer) -> str:
    below = layer_key(LAYERS[layer.below]) if layer.below else None
    spec = {"python": sys.version_info[:2], "platform": sysconfig.get_platform(),
            "steps": [_step_text(s) for s in layer.steps], "below": below}
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    return f"{layer.name}-{digest}"


def layer_path(layer: Layer) -> Path:
    return cache_dir() / layer_key(layer)


def site_packages(env: Path) -> Path:
    v = sys.version_info
    return env / "lib" / f"python{v[0]}.{v[1]}" / "site-packages"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _venv(path: Path, base_python: str) -> None:
    # --without-pip: pip comes from the torch layer (upgraded there once), through the .pth
    subprocess.run([base_python, "-m", "venv", "--without-pip", str(path)], check=True)


def _link_below(env: Path, below: Path) -> None:
    """``env`` sees ``below``'s packages (and, through its own .pth, the layers under it)."""
    (site_packages(env) / LAYER_PTH).write_text(
        f"import site; site.addsitedir({str(site_packages(below))!r})\n")


def _pip(env: Path, *args: str, verb: str = "install") -> None:
    # PYTHONWARNINGS: setuptools' editable build warns in ten lines about folders named like
    # the package, which is what an editable checkout is
    subprocess.run([str(env / "bin" / "python"), "-m", "pip", verb,
                    "--disable-pip-version-check", *args], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONWARNINGS": "ignore"})


def _install(env: Path, step: tuple[str, ...]) -> None:
    """One step through the machine's wheelhouse (``<cache>/wheels``): pip downloads into it
    only the files it does not hold yet (pip's own HTTP cache may be off: it is here), then
    installs from it alone. A step that resolves dependencies is downloaded with torch pinned
    as the torch layer has it, so the resolver never reaches for another (CUDA) build."""
    wheels = cache_dir() / "wheels"
    extra = () if "--no-deps" in step else TORCH
    with _locked(wheels.with_suffix(".lock")):
        _pip(env, "--quiet", "--dest", str(wheels), *step, *extra, verb="download")
        _build_sdists(env, wheels)
    _pip(env, "--no-index", "--find-links", str(wheels), *step)


def _build_sdists(env: Path, wheels: Path) -> None:
    """A wheel, once, for every source distribution in the wheelhouse (``hqq``, for one): an
    install from the wheelhouse alone could not fetch the packages its build needs."""
    built = {w.name.lower() for w in wheels.glob("*.whl")}
    for sdist in sorted([*wheels.glob("*.tar.gz"), *wheels.glob("*.zip")]):
        stem = sdist.name.removesuffix(".tar.gz").removesuffix(".zip")
        name, _, version = stem.rpartition("-")
        prefix = f"{re.sub(r'[-_.]+', '_', name).lower()}-{version.lower()}-"
        if not any(w.startswith(prefix) for w in built):
            _pip(env, "--quiet", "--no-deps", "--wheel-dir", str(wheels), str(sdist), verb="wheel")


def ensure_layer(layer: Layer, base_python: str) -> tuple[Path, bool]:
    """The layer's folder, built if no complete one exists; ``(path, built)``."""
    below = ensure_layer(LAYERS[layer.below], base_python)[0] if layer.below else None
    path = layer_path(layer)
    with _locked(path.with_suffix(".lock")):
        if (path / DONE).exists():
            return path, False
        shutil.rmtree(path, ignore_errors=True)  # an earlier build that did not finish
        print(f"env: building layer {path.name} in {path.parent} (once per machine)", flush=True)
        try:
            if below is None:
                subprocess.run([base_python, "-m", "venv", str(path)], check=True)
            else:
                _venv(path, base_python)
                _link_below(path, below)
            for step in layer.steps:
                if layer.wheelhouse:
                    _install(path, step)
                else:
                    _pip(path, *step)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        (path / DONE).write_text(json.dumps({"layer": layer.name, "below": str(below) if below
                                             else None, "steps": layer.steps}, indent=1))
    return path, True


def _layers_under(top: Path) -> list[Path]:
    """``top`` and every layer below it, top first."""
    out = [top]
    while True:
        info = json.loads((out[-1] / DONE).read_text())
        if not info["below"]:
            return out
        out.append(Path(info["below"]))


def _copy_scripts(env: Path, top: Path) -> None:
    """The layers' console scripts, run by ``env``'s interpreter (so ``sglang generate`` or
    ``pytest`` sees this checkout's causalkv); native programs (ruff) are linked."""
    bin_dir = env / "bin"
    for layer in _layers_under(top):
        python = str(layer / "bin" / "python")
        for script in sorted((layer / "bin").iterdir()):
            name = script.name
            target = bin_dir / name
            if target.exists() or target.is_symlink() or not script.is_file() or name.startswith(
                    ("python", "pip", "activate", "Activate", "deactivate")):
                continue
            head = script.read_bytes()[:512]
            if head.startswith(b"#!") and python.encode() in head:
                # the interpreter is named in the first line, or in the third of pip's
                # `#!/bin/sh` form for long paths
                lines = script.read_text().split("\n")
                lines[:3] = [line.replace(python, str(bin_dir / "python")) for line in lines[:3]]
                target.write_text("\n".join(lines))
                target.chmod(0o755)
            elif not head.startswith(b"#!"):
                target.symlink_to(script)


def ensure_checkout_env(name: str, dest: Path, base_python: str) -> tuple[Path, bool, bool]:
    """The checkout's environment ``dest`` over the layer ``name``, with causalkv from this
    checkout; ``(layer, layer built, env made)``."""
    top, built = ensure_layer(LAYERS[name], base_python)
    want = {"layer": str(top), "checkout": str(ROOT),
            "pyproject": hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:12]}
    marker = dest / CHECKOUT
    if marker.exists() and not dest.is_symlink():
        with contextlib.suppress(ValueError):
            if json.loads(marker.read_text()) == want and (dest / "bin" / "python").exists():
                return top, built, False
    if dest.is_symlink() or dest.is_file():
        dest.unlink()  # an older layout's link into a shared environment
    elif dest.exists():
        shutil.rmtree(dest)
    _venv(dest, base_python)
    _link_below(dest, top)
    _pip(dest, "--quiet", "--no-deps", "--no-build-isolation", "-e", str(ROOT))
    _copy_scripts(dest, top)
    marker.write_text(json.dumps(want, indent=1))
    return top, built, True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=[n for n in LAYERS if n != "torch"],
                    help="which environment")
    ap.add_argument("dest", type=Path, help="the checkout's environment folder (e.g. .venv)")
    ap.add_argument("--print-layer", action="store_true",
                    help="print the cached layer's folder for NAME and exit (nothing built)")
    a = ap.parse_args(argv)
    if a.print_layer:
        print(layer_path(LAYERS[a.name]))
        return 0
    t0 = time.monotonic()
    dest = a.dest if a.dest.is_absolute() else Path.cwd() / a.dest
    top, built, made = ensure_checkout_env(a.name, dest, sys.executable)
    how = ("layer built, " if built else "layer reused, ") + ("env made" if made else "env reused")
    print(f"env {a.name}: {how} ({top.name}), {time.monotonic() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
