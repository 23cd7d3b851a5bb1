"""``causalkv plugins`` and ``causalkv resolve``: inspect plugins and load-time resolution.

Neither command loads model weights; ``resolve`` reads at most a ``model_index.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from typing import Any

from causalkv import __version__
from causalkv.caches.codecs import CodecSetting, codec_names, codec_setting, make_codec
from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.cli.generate import (
    _PLUGINS,
    add_extension_args,
    collect_plugins,
    extension_records,
    host_flags,
)
from causalkv.config import MULTI_SHOT, ServerArgs
from causalkv.errors import CausalKVError, describe_exception, print_stderr
from causalkv.hooks import NAME, HostClassRegistration, import_object
from causalkv.plugin import builtin as builtin_plugin
from causalkv.plugin import collect, get_plugin_manager
from causalkv.runtime.host.resolve import Resolution, resolve
from causalkv.runtime.model_io.model_config import is_loadable_model, model_head_dim, model_ref

__all__ = ["plugin_rows", "plugins_report", "register", "resolution_dict", "run_plugins", "run_resolve"]


def register(subparsers: argparse._SubParsersAction, *, plugins: Any = ...) -> None:
    """Add the ``plugins`` and ``resolve`` subcommands to the ``causalkv`` parser; ``resolve``
    takes the flags of ``plugins``' stages and caches (default: collected now)."""
    p = subparsers.add_parser(
        "plugins",
        help="list loaded plugins, stages and caches",
        description="List the loaded plugins (name, version, distribution, hooks), the "
        "registered stages (models, QVG support, cache features needed), the registered "
        "caches (capabilities), codecs and host classes (host, class, models, cache, codec; "
        "one that does not import is marked), plus plugins that failed to load.",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--all", action="store_true", help="include the built-in plugin")
    p.set_defaults(func=run_plugins)

    r = subparsers.add_parser(
        "resolve",
        help="show the stage and cache a model resolves to (no weights load)",
        description="Resolve MODEL (a preset name or a diffusers-format folder) to a stage "
        "and a cache under the given flags, and explain why. Exit status 2 on failure.",
    )
    r.add_argument("model", metavar="MODEL", help="preset name or diffusers-format folder")
    r.add_argument("--multi-shot", action="store_true",
                   help="scene cuts pin a shot sink (needs pinned_sink)")
    r.add_argument("--heads-sharded", type=int, default=1, metavar="N",
                   help="ranks sharing the attention heads (> 1 needs head_slice)")
    r.add_argument("--recent-window-frames", type=int, default=None, metavar="N",
                   help="sample a recent window of N frames (needs recent_window)")
    r.add_argument("--cache", default=None, metavar="NAME", help="force a cache by name")
    r.add_argument("--stage", default=None, metavar="NAME", help="force a stage by name")
    r.add_argument("--json", action="store_true", help="print JSON")
    plugins = collect_plugins() if plugins is ... else plugins
    add_extension_args(r, plugins)  # the stages' and caches' own flags (--kv-cache-quant, ...)
    r.set_defaults(func=run_resolve, **{_PLUGINS: plugins})


#: a trigger ``causalkv plugins`` lists whose flag differs between generate and resolve
SHARDED = "--nproc-per-node N > 1 (resolve: --heads-sharded N)"


def _fail(command: str, exc: BaseException) -> int:
    print_stderr(f"{NAME} {command}: error: {exc}")
    return 2


def _stage_row(entry: Any) -> dict[str, Any]:
    reg = entry.registration
    row: dict[str, Any] = {"name": reg.name, "class": reg.target, "models": list(reg.served),
                           "priority": reg.priority, "plugin": entry.plugin}
    try:
        cls = entry.load()
    except (ImportError, TypeError) as exc:
        row["error"] = str(exc)
        return row
    qvg, multi = cls._supports_qvg_kv_cache_quantization(), cls.supports_multi_shot()
    # each trigger as generate takes it, then as resolve does where the two differ
    cases = {
        "always": ServerArgs(),
        "--kv-cache-quant": ServerArgs(options=[QVGKVQuantArgs(codec="int4")]) if qvg else None,
        MULTI_SHOT: ServerArgs(multi_shot=True) if multi else None,
        SHARDED: ServerArgs(heads_sharded=2),
        "--recent-window-frames": ServerArgs(recent_window_frames=1),
    }
    needed = {flag: sorted(cls.required_cache_features(a)) for flag, a in cases.items() if a}
    return {**row, "qvg": qvg, "multi_shot": multi, "features_needed": needed}


def _codec_row(setting: CodecSetting) -> dict[str, Any]:
    """A codec setting as ``causalkv plugins`` lists it, with ``error`` when it is broken: its
    target does not import, or the codec fails its conformance check (`make_codec` runs it)."""
    row: dict[str, Any] = {"name": setting.name, "target": setting.target, "params": dict(setting.params),
                           "help": setting.help, "plugin": setting.source}
    try:
        make_codec(setting.name, QVGKVQuantArgs(codec=setting.name))
    except CausalKVError as exc:
        row["error"] = str(exc)
    except Exception as exc:  # noqa: BLE001 - a broken plugin codec must not take the listing down
        row["error"] = f"codec setting {setting.name!r} ({setting.target}): {describe_exception(exc)}"
    return row


def _host_row(reg: HostClassRegistration, plugin: str) -> dict[str, Any]:
    """A host registration as ``causalkv plugins`` lists it: with ``error`` when its target
    does not import, or ``unchecked`` when its host is not installed in this environment (then
    no host class imports: nothing to judge)."""
    row: dict[str, Any] = {"host": reg.host, "target": reg.target, "models": list(reg.models), "codec": reg.codec,
                           "cache": reg.cache, "priority": reg.priority, "plugin": plugin}
    package = reg.host.replace("-", "_")
    if importlib.util.find_spec(package) is None:
        row["unchecked"] = f"host {reg.host} is not installed here (no module {package!r})"
        return row
    try:
        import_object(reg.target)
    except Exception as exc:  # noqa: BLE001 - a broken plugin class must not take the listing down
        row["error"] = f"{reg.target} (plugin {plugin}) cannot be imported: {describe_exception(exc)}"
    return row


def _cache_row(factory: Any, plugin: str) -> dict[str, Any]:
    """A cache factory as ``causalkv plugins`` and ``causalkv resolve --json`` show it."""
    return {"name": factory.name, "target": factory.target, "capabilities": list(factory.features()),
            "priority": factory.priority, "plugin": plugin}


def plugin_rows(pm: Any) -> list[dict[str, Any]]:
    """The registered plugins as ``causalkv plugins`` lists them: the built-in one first, then
    by name; each with its name, version and distribution (None for a plugin registered
    in-process), the causalkv hooks it implements (sorted) and whether it is the built-in one."""
    rows, dists = [], pm.distributions
    for name, plugin in pm.list_name_plugin():
        if plugin is None:  # a blocked name
            continue
        builtin = plugin is builtin_plugin
        dist_name, _, version = (f"{NAME} {__version__}" if builtin else dists.get(name) or "").rpartition(" ")
        rows.append({
            "name": name,
            "version": version or None,
            "distribution": dist_name or None,
            "hooks": sorted(c.name for c in pm.get_hookcallers(plugin) or ()),
            "builtin": builtin,
        })
    return sorted(rows, key=lambda row: (not row["builtin"], row["name"]))


def resolution_dict(res: Resolution) -> dict[str, Any]:
    """A JSON-serializable summary of a `Resolution` (``causalkv resolve --json``)."""
    return {
        "model": res.model.name,
        "model_class": res.model.model_class,
        "stage": {
            "name": res.stage_name,
            "class": f"{res.stage.__module__}:{res.stage.__qualname__}",
            "plugin": res.stage_plugin,
            "priority": res.stage_registration.priority,
        },
        "cache": _cache_row(res.cache_factory, res.cache_plugin),
        "requirements": sorted(res.requirements),
        "reasons": list(res.reasons),
    }


def plugins_report(pm: Any, *, include_builtin: bool) -> dict[str, Any]:
    """What ``causalkv plugins --json`` prints: the plugins set aside included (the same
    `causalkv generate` meets: its flags are the reserved ones)."""
    registry = collect(pm, reserved_flags=host_flags(), report=None)
    rows = plugin_rows(pm)
    return {
        "plugins": [row for row in rows if include_builtin or not row["builtin"]],
        "hidden_builtin": 0 if include_builtin else sum(row["builtin"] for row in rows),
        "stages": [_stage_row(e) for e in registry.stages],
        "caches": [_cache_row(e.factory, e.plugin) for e in registry.caches],
        "codecs": [_codec_row(codec_setting(name)) for name in codec_names()],
        "hosts": [_host_row(reg, plugin) for reg, plugin in registry.hosts],
        "failures": [
            {"name": f.name, "distribution": f.distribution, "error": f.error, "line": str(f)}
            for f in (*pm.load_failures, *registry.failures)
        ],
        "missing_allowed": list(pm.missing_allowed),
    }


def _print_plugins(report: dict[str, Any]) -> None:
    print("Plugins:")
    for p in report["plugins"]:
        dist = f" ({p['distribution']} {p['version']})" if p["distribution"] else ""
        print(f"  {p['name']}{dist}: {', '.join(p['hooks']) or '(no hooks)'}")
    if not report["plugins"]:
        print("  (none)")
    if report["hidden_builtin"]:
        print("  (the built-in plugin is hidden; --all lists it)")
    print("Stages:")
    for s in report["stages"]:
        print(f"  {s['name']} ({s['class']}, plugin {s['plugin']}, priority {s['priority']})")
        print(f"      models: {', '.join(s['models'])}")
        if "error" in s:
            print(f"      error: {s['error']}")
            continue
        yes = {True: "yes", False: "no"}
        print(f"      QVG: {yes[s['qvg']]}   multi-shot: {yes[s['multi_shot']]}")
        needs = [f"{flag}: {', '.join(f) or 'none'}" for flag, f in s["features_needed"].items()]
        print(f"      cache features needed: {'; '.join(needs)}")
    print("Caches:")
    for c in report["caches"]:
        print(f"  {c['name']} ({c['target']}, plugin {c['plugin']}, priority {c['priority']})")
        print(f"      capabilities: {', '.join(c['capabilities']) or '(none)'}")
    print("Codecs (--kv-cache-quant, --kv-cache-quant-recent-tier):")
    for c in report["codecs"]:
        params = "".join(f" {k}={v}" for k, v in c["params"].items())
        print(f"  {c['name']} ({c['target']}{params}, plugin {c['plugin']}): {c['help']}")
        if "error" in c:
            print(f"      error: {c['error']}")
    print("Host classes (causalkv serves them in their host, built by the cache factory named):")
    for h in report["hosts"]:
        print(f"  {h['host']} {h['target']} (plugin {h['plugin']}, priority {h['priority']})")
        print(f"      models: {', '.join(h['models'])}   cache: {h['cache'] or '(the host default)'}"
              f"   codec: {h['codec'] or '(the host default)'}")
        for key in ("error", "unchecked"):
            if key in h:
                print(f"      {key}: {h[key]}")
    if report["failures"]:
        print("Set aside (every other plugin and model works; --strict-plugins makes it fatal):")
        for f in report["failures"]:
            print(f"  {f['line']}")
    if report["missing_allowed"]:
        print(f"Allowed but not installed: {', '.join(report['missing_allowed'])}")


def run_plugins(args: argparse.Namespace) -> int:
    try:
        report = plugins_report(get_plugin_manager(), include_builtin=args.all)
    except (CausalKVError, RuntimeError, TypeError) as exc:
        return _fail("plugins", exc)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_plugins(report)
    return 0


def run_resolve(args: argparse.Namespace) -> int:
    try:
        # the flags whose dest is the ServerArgs field of the same name
        same = ("multi_shot", "heads_sharded", "recent_window_frames", "cache")
        server_args = ServerArgs(options=extension_records(args),
                                 **{name: getattr(args, name) for name in same})
        found = getattr(args, _PLUGINS, None)  # the plugins the parser was built from
        where = {"pm": found.pm, "registry": found.registry} if found is not None else {}
        res = resolve(model_ref(args.model), server_args, stage=args.stage, **where)
        settings = res.cache_options
        given = settings is not None and bool(settings.changed())
        head_dim = model_head_dim(args.model) if given else None
        if head_dim is not None:
            settings.check_layout(head_dim)
    except (CausalKVError, ImportError, TypeError, RuntimeError) as exc:
        return _fail("resolve", exc)
    notes = []
    if given and head_dim is None:
        notes.append(
            f"{args.model!r} has no transformer config here: the block size is checked against "
            "head_dim when causalkv generate reads one"
        )
    if not is_loadable_model(args.model):
        notes.append(
            f"{args.model!r} is a served model name, not a preset or a model folder: causalkv "
            "generate needs a preset or a folder to load weights from"
        )
    d = {**resolution_dict(res), "notes": notes}
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    print(f"model: {res.model.name}" + (f" ({res.model.model_class})" if res.model.model_class else ""))
    print(f"stage: {d['stage']['name']} ({d['stage']['class']}, plugin {d['stage']['plugin']})")
    print(f"cache: {d['cache']['name']} ({d['cache']['target']}, plugin {d['cache']['plugin']})")
    print(f"requirements: {', '.join(d['requirements']) or 'none'}")
    print("reasons:")
    for line in res.reasons:
        print(f"  - {line}")
    for line in notes:
        print(f"note: {line}")
    return 0
