"""The path of one command-line flag from ``causalkv generate`` to the first KV-cache write.

    .venv/bin/python benchmarks/flag_path.py                     # --kv-cache-quant int2 on tiny-wan
    .venv/bin/python benchmarks/flag_path.py --show-calls        # also every function that held it

Runs ``causalkv generate --model tiny-wan --kv-cache-quant int2 --kv-cache-quant-keep-recent 0``
(two chunks of three frames, no video written: the first chunk is packed, so the flag takes
effect and the run warns of nothing) in this process under `sys.setprofile`, and records, in call order, each module
of the package whose function is passed the flag as an argument (``self`` aside: a method of an
object that carries the flag does not move it): the parsed argparse namespace carrying
it (the record's flags are stored there under ``"<module>.QVGKVQuantArgs.<field>"``), the QVG settings record built from it (`QVGKVQuantArgs`), or an object a
few attributes away from that record (the request, the plan, the resolution). It stops at the
first call of the packed cache's write (``QVGPackedCausalKVCache._write``, what the cache
contract's ``update_and_get_attention_kv`` calls once it has checked the call), and so does the run (a few seconds:
the default run is already the smallest, and the one the test runs).

Printed: the modules entered, in order (consecutive calls in one module count once), how many
distinct modules that is, how many times the flag comes back to a module it had left, and the
distinct hops (module A to module B) with those of them that go back into a module already
entered (a hop taken once per layer, or once per chunk, counts once there). The
count is the same for any checkout with that command line, so two trees can be compared by
running this file from each (``PYTHONPATH=<checkout> .venv/bin/python benchmarks/flag_path.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

RECORD = "QVGKVQuantArgs"  # the settings record the flag becomes
STOP = "QVGPackedCausalKVCache._write"  # the packed cache's write (behind the contract's checks)


def holds(value: Any, depth: int = 3) -> bool:
    """Does ``value`` carry the flag, itself or within ``depth`` attributes / items?"""
    if type(value).__name__ == RECORD:
        return True
    if isinstance(value, argparse.Namespace):  # given record flags are stored as "<module>.<Record>.<field>"
        return any(f".{RECORD}." in name for name in vars(value))
    if depth == 0 or isinstance(value, (str, bytes, int, float, type)):
        return False
    if isinstance(value, (tuple, list)):
        return any(holds(v, depth - 1) for v in value[:32])
    if isinstance(value, dict):
        return any(holds(v, depth - 1) for v in list(value.values())[:32])
    if not type(value).__module__.startswith("causalkv"):
        return False
    try:
        attrs = vars(value)
    except TypeError:  # no __dict__
        return False
    return any(holds(v, depth - 1) for v in attrs.values())


class _Reached(BaseException):
    """Raised by the profile function at the first cache write: the run ends there (a
    ``BaseException``, so the command's own ``except Exception`` handling lets it through)."""


def trace(argv: list[str]) -> tuple[list[str], list[str]]:
    """Run ``causalkv`` with ``argv``; the modules entered with the flag (collapsed) and
    every ``module:function`` it was passed to."""
    import causalkv.cli.commands  # noqa: F401  (imported before the profile: an import moves no flag)
    from causalkv.cli import main

    modules: list[str] = []
    calls: list[str] = []
    done = False

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal done
        if done or event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("causalkv"):
            return
        code = frame.f_code
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        passed = [frame.f_locals.get(n) for n in names if n not in ("self", "cls")]
        stop = code.co_qualname == STOP
        if not stop and not any(holds(v) for v in passed):
            return
        calls.append(f"{module}:{frame.f_code.co_qualname}")
        if not modules or modules[-1] != module:
            modules.append(module)
        if stop:
            done = True
            raise _Reached  # the rest of the run is not measured: stop it (unsets the profile)

    sys.setprofile(profile)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit, _Reached):
            main(argv)
    finally:
        sys.setprofile(None)
    if not done:
        raise SystemExit(f"the run never called {STOP} while holding the flag: {' '.join(argv)}")
    return modules, calls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--show-calls", action="store_true", help="also list every function that held the flag")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as home:
        metrics = Path(home) / "metrics.json"
        run = ["generate", "--model", "tiny-wan", "--kv-cache-quant", "int2",
               "--kv-cache-quant-keep-recent", "0", "--frames", "6", "--quiet", "--metrics", str(metrics)]
        os.environ["CAUSALKV_HOME"] = home  # the preset is built here, not in the user's home
        modules, calls = trace(run)
    short = [m.removeprefix("causalkv.") for m in modules]
    returns = sum(1 for i, m in enumerate(short) if m in short[:i])
    hops = set(zip(short, short[1:]))
    back = {(a, b) for i, (a, b) in enumerate(zip(short, short[1:])) if b in short[: i + 1]}
    print(f"causalkv {' '.join(run[:9])} ...: the flag's path to the first cache write")
    print(f"modules entered, in order ({len(short)} stays, {len(set(short))} modules, "
          f"{returns} returns to a module already left; {len(hops)} distinct hops between "
          f"modules, {len(back)} of them back into one already entered):")
    print("  " + " -> ".join(short))
    if a.show_calls:
        for c in calls:
            print(f"    {c}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
