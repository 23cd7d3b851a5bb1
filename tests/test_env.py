"""`causalkv.env`: the one reader of environment variables (one truthiness rule for a switch, a
choice that names the variable, the value and the choices), and the readers that use it."""

from __future__ import annotations

import pytest

from causalkv import env
from causalkv.errors import ConfigError


@pytest.mark.parametrize("value", ["1", "true", "YES", " on ", "True"])
def test_a_flag_is_on_for_its_on_values(value: str) -> None:
    assert env.flag("X", default=False, environ={"X": value}) is True


@pytest.mark.parametrize("value", ["0", "false", "No", " off"])
def test_a_flag_is_off_for_its_off_values(value: str) -> None:
    assert env.flag("X", default=True, environ={"X": value}) is False


@pytest.mark.parametrize("environ", [{}, {"X": ""}, {"X": "  "}])
@pytest.mark.parametrize("default", [True, False])
def test_a_flag_unset_or_blank_is_its_default(environ: dict[str, str], default: bool) -> None:
    assert env.flag("X", default=default, environ=environ) is default


def test_a_flag_refuses_another_value_naming_it_unless_lenient() -> None:
    with pytest.raises(ConfigError) as exc:
        env.flag("X", default=False, meaning="1 does it", environ={"X": "maybe"})
    assert str(exc.value) == (
        "X='maybe': choose one of ['1', 'true', 'yes', 'on', '0', 'false', 'no', 'off'] (1 does it), or unset it"
    )
    assert env.flag("X", default=True, environ={"X": "maybe"}, strict=False) is True
    assert env.flag("X", default=False, environ={"X": "2"}, strict=False) is False


def test_a_choice_is_one_of_its_names_or_its_default() -> None:
    assert env.choice("C", ("a", "b"), default="a", environ={"C": " B "}) == "b"
    assert env.choice("C", ("a", "b"), default="a", environ={"C": ""}) == "a"
    assert env.choice("C", ("a", "b"), default=None, environ={}) is None
    with pytest.raises(ConfigError, match=r"^C='z': choose one of \['a', 'b'\] \(what it picks\), or unset it$"):
        env.choice("C", ("a", "b"), default="a", meaning="what it picks", environ={"C": "z"})


def test_text_and_names() -> None:
    assert env.text("H", {"H": "/x"}) == "/x" and env.text("H", {"H": " "}) is None and env.text("H", {}) is None
    assert env.names("P", {}) is None
    assert env.names("P", {"P": ""}) == frozenset()  # set but empty: no names
    assert env.names("P", {"P": " a, b,,"}) == frozenset({"a", "b"})


def test_the_os_environment_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAUSALKV_TEST_SWITCH", "on")
    assert env.flag("CAUSALKV_TEST_SWITCH", default=False)
    monkeypatch.delenv("CAUSALKV_TEST_SWITCH")
    assert not env.flag("CAUSALKV_TEST_SWITCH", default=False)


def test_check_switches_refuses_a_value_a_switch_does_not_take() -> None:
    switches = (env.Switch("F", env.FLAG_VALUES, "1 does it"), env.Switch("C", ("a", "b"), "a or b"))
    env.check_switches(switches, {"F": "yes", "C": "", "OTHER": "anything"})
    with pytest.raises(ConfigError) as exc:
        env.check_switches(switches, {"F": "2"})
    assert str(exc.value) == ("F='2' is not one of its values (1, true, yes, on, 0, false, no, off or empty): "
                              "1 does it; set one of them or unset it")
    with pytest.raises(ConfigError, match=r"^C='z' is not one of its values \(a, b or empty\): a or b;"):
        env.check_switches(switches, {"C": "z"})


def test_the_bridges_switches_follow_the_one_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    import causalkv.sglang as sglang_bridge
    import causalkv.vllm_omni as vllm_omni_bridge

    for bridge in (sglang_bridge, vllm_omni_bridge):
        for value, on in (("0", False), ("OFF", False), ("no", False), ("1", True), ("", True), ("maybe", True)):
            monkeypatch.setenv(bridge.ENV_SWITCH, value)
            assert bridge.enabled() is on, (bridge.ENV_SWITCH, value)
        monkeypatch.delenv(bridge.ENV_SWITCH)
        assert bridge.enabled()


def test_the_codec_backend_and_the_triton_interpreter_read_through_the_helper(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch = pytest.importorskip("torch")
    from causalkv.caches.codecs.prq import quantizer, triton_impl

    cpu = torch.device("cpu")
    monkeypatch.setenv(quantizer.BACKEND_ENV, " Torch ")
    assert quantizer.resolve_backend(None, cpu) == "torch"
    monkeypatch.setenv(quantizer.BACKEND_ENV, "")
    assert quantizer.resolve_backend(None, cpu) == "torch"  # blank: auto
    for value, on in (("1", True), ("yes", True), ("0", False), ("2", False)):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert triton_impl.interpreting() is on, value


def test_causalkv_home_unset_or_blank_is_the_default(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from causalkv.runtime.model_io.preset_configs import ENV_HOME, causalkv_home

    monkeypatch.setenv(ENV_HOME, str(tmp_path))
    assert causalkv_home() == tmp_path
    monkeypatch.setenv(ENV_HOME, "")
    assert causalkv_home().name == "causalkv" and causalkv_home().parent.name == ".cache"


# ---- causalkv's own variables are read through this module only ------------------------------
def _raw_reads(tree) -> list[tuple[int, object]]:
    """``(line, key)`` of every read of ``os.environ`` / ``os.getenv`` in ``tree``: a subscript,
    ``.get(key)``, ``key in os.environ`` and ``os.getenv(key)``; ``key`` is the string read (a
    literal, or a module-level name bound to one), else the key's expression."""
    import ast

    consts = {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
              and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
              for t in node.targets if isinstance(t, ast.Name)}

    def key(expr):
        if isinstance(expr, ast.Constant):
            return expr.value
        return consts.get(expr.id, expr) if isinstance(expr, ast.Name) else expr

    def environ(expr) -> bool:
        return ast.unparse(expr) == "os.environ"

    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and environ(node.value):
            out.append((node.lineno, key(node.slice)))
        elif isinstance(node, ast.Call) and node.args and (
                ast.unparse(node.func) in ("os.environ.get", "os.getenv")):
            out.append((node.lineno, key(node.args[0])))
        elif isinstance(node, ast.Compare) and any(environ(c) for c in node.comparators):
            out.append((node.lineno, key(node.left)))
    return out


def test_causalkvs_own_variables_are_read_through_the_helper() -> None:
    """A ``CAUSALKV_*`` variable is read by `causalkv.env` alone (one rule for unset and blank);
    the variables of a host or a launcher (torchrun's ``WORLD_SIZE``) may be read its way."""
    import ast
    from pathlib import Path

    sample = ast.parse("import os\nA = 'CAUSALKV_A'\nos.environ[A]\nos.environ.get('CAUSALKV_B')\n"
                       "'CAUSALKV_C' in os.environ\nos.getenv('RANK')\n")
    assert [k for _, k in _raw_reads(sample)] == ["CAUSALKV_A", "CAUSALKV_B", "CAUSALKV_C", "RANK"]
    root = Path(env.__file__).resolve().parent
    found = [f"{path.relative_to(root.parent)}:{line} reads {k}"
             for path in sorted(root.rglob("*.py")) if path != Path(env.__file__).resolve()
             for line, k in _raw_reads(ast.parse(path.read_text()))
             if isinstance(k, str) and k.startswith("CAUSALKV_")]
    assert not found, "\n".join(found)
