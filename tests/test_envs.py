"""The flag registry (vllm_omni_edge/envs.py): values, clear errors, the generated doc, and that
nothing in the package reads a flag of ours around it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from vllm_omni_edge import envs
from vllm_omni_edge.envs import FlagError

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "vllm_omni_edge"
# Flags still read, through levers/__init__.py, by modules being removed; drop each name here
# once nothing mentions it.
UNREGISTERED: set[str] = set()


def test_the_flags_doc_is_generated_from_the_registry():
    doc = (REPO / "docs/edge/flags.md").read_text()
    assert doc == envs.render_markdown(), "run: vllm-omni-edge flags --markdown > docs/edge/flags.md"


def test_every_flag_is_declared_whole():
    assert len(envs.REGISTRY) == len(envs.FLAGS)
    for flag in envs.FLAGS:
        assert flag.name.startswith(envs.PREFIX) and flag.name.upper() == flag.name
        assert flag.doc and "\n" not in flag.doc, flag.name
        assert flag.modules, flag.name
        for module in flag.modules:
            assert (PACKAGE / module).is_file(), f"{flag.name}: no module {module}"
        assert flag.read({}) == flag.default  # unset is the default
        assert flag.read({flag.name: "  "}) == flag.default  # so is blank


def test_the_forced_kernel_takes_exactly_the_kernels_there_are():
    from vllm_omni_edge.quantization.kernels import KERNEL_ENV, KERNELS

    assert set(envs.flag(KERNEL_ENV).choices) == set(KERNELS)


def test_values_read_as_the_code_uses_them():
    env = {"VLLM_OMNI_EDGE_ROPE_CAP": "0", "VLLM_OMNI_EDGE_EMBED_PREPACK": " 1 ",
           "VLLM_OMNI_EDGE_KV_DEFAULT": "VLLM", "VLLM_OMNI_EDGE_SHM_SPIN_S": "0.5",
           "VLLM_OMNI_EDGE_MAX_REQUEST_BYTES": "1024", "VLLM_OMNI_EDGE_CACHE": "~/edge"}
    assert envs.get("VLLM_OMNI_EDGE_ROPE_CAP", env) is False
    assert envs.get("VLLM_OMNI_EDGE_EMBED_PREPACK", env) is True
    assert envs.get("VLLM_OMNI_EDGE_KV_DEFAULT", env) == "vllm"  # choices ignore case
    assert envs.get("VLLM_OMNI_EDGE_SHM_SPIN_S", env) == 0.5
    assert envs.get("VLLM_OMNI_EDGE_MAX_REQUEST_BYTES", env) == 1024
    assert envs.get("VLLM_OMNI_EDGE_CACHE", env) == Path.home() / "edge"
    assert envs.get("VLLM_OMNI_EDGE_INT4_KERNEL", env) is None  # unset: the router decides


def test_attribute_access_reads_the_environment_each_time(monkeypatch):
    monkeypatch.delenv("VLLM_OMNI_EDGE_INT4_PREFILL", raising=False)
    assert envs.VLLM_OMNI_EDGE_INT4_PREFILL == "auto"
    monkeypatch.setenv("VLLM_OMNI_EDGE_INT4_PREFILL", "w4a8")
    assert envs.VLLM_OMNI_EDGE_INT4_PREFILL == "w4a8"
    with pytest.raises(AttributeError, match="VLLM_OMNI_EDGE_NOT_A_FLAG"):
        envs.VLLM_OMNI_EDGE_NOT_A_FLAG  # noqa: B018
    with pytest.raises(KeyError, match="declare it in vllm_omni_edge/envs.py"):
        envs.get("VLLM_OMNI_EDGE_NOT_A_FLAG")


@pytest.mark.parametrize("name, raw, expected", [
    ("VLLM_OMNI_EDGE_ROPE_CAP", "true", "expected 1 (on) or 0 (off)"),
    ("VLLM_OMNI_EDGE_HEAP_TRIM", "yes", "expected 1 (on) or 0 (off)"),
    ("VLLM_OMNI_EDGE_INT4_LAYOUTS", "three", "expected one of one, two"),
    ("VLLM_OMNI_EDGE_STARTUP_GC", "maybe", "expected one of young, 1, pause, 0"),
    ("VLLM_OMNI_EDGE_INT4_KERNEL", "fastest", "expected one of int4pack, "),
    ("VLLM_OMNI_EDGE_SHM_SPIN_S", "-1", "expected seconds, a number >= 0"),
    ("VLLM_OMNI_EDGE_SHM_SPIN_S", "inf", "expected seconds, a number >= 0"),
    ("VLLM_OMNI_EDGE_SHM_SPIN_S", "nan", "expected seconds, a number >= 0"),
    ("VLLM_OMNI_EDGE_SHM_SPIN_S", "soon", "expected seconds, a number >= 0"),
    ("VLLM_OMNI_EDGE_MAX_REQUEST_BYTES", "0", "expected bytes, a whole number > 0"),
    ("VLLM_OMNI_EDGE_MAX_REQUEST_BYTES", "1.5", "expected bytes, a whole number > 0"),
    ("VLLM_OMNI_EDGE_RESERVED_CPU_CHOSEN", "2", "expected 1 (on) or 0 (off)"),
])
def test_a_bad_value_is_an_error_naming_variable_value_and_what_is_allowed(monkeypatch, name, raw, expected):
    monkeypatch.setenv(name, raw)
    with pytest.raises(FlagError, match=re.escape(f"{name}={raw!r}: {expected}")):
        envs.get(name)
    with pytest.raises(ValueError):  # callers that catch ValueError still do
        getattr(envs, name)


def test_every_flag_but_a_directory_refuses_some_value():
    for flag in envs.FLAGS:
        if isinstance(flag, envs.Directory):
            continue
        with pytest.raises(FlagError, match=re.escape(f"{flag.name}='not a value': expected {flag.allowed}")):
            flag.read({flag.name: "not a value"})


def test_set_env_writes_what_readers_accept_and_refuses_the_rest(monkeypatch):
    name = "VLLM_OMNI_EDGE_SINGLE_PROCESS"
    monkeypatch.delenv(name, raising=False)
    assert not envs.is_set(name)
    envs.set_env(name, False)
    assert envs.is_set(name) and envs.get(name) is False
    with pytest.raises(FlagError, match=f"{name}='yes'"):
        envs.set_env(name, "yes")
    assert envs.get(name) is False  # the refused value was not written


def test_unknown_names_are_ours_that_nothing_reads():
    environ = {"VLLM_OMNI_EDGE_ROPECAP": "0", "VLLM_OMNI_EDGE_ROPE_CAP": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    assert envs.unknown(environ) == ["VLLM_OMNI_EDGE_ROPECAP"]
    assert envs.snapshot(environ) == {"VLLM_OMNI_EDGE_ROPECAP": "0", "VLLM_OMNI_EDGE_ROPE_CAP": "0"}


# --- nothing reads a flag of ours around the registry ------------------------------------------


def _constants(tree: ast.Module) -> dict[str, str]:
    return {node.targets[0].id: node.value.value for node in tree.body
            if isinstance(node, ast.Assign) and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}


def _is_environ(node: ast.AST) -> bool:
    """``os.environ``, a bare ``environ``, or either as a branch of ``... if ... else ...``."""
    if isinstance(node, ast.IfExp):
        return _is_environ(node.body) or _is_environ(node.orelse)
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ")


def environ_uses_of_ours(source: str, known: dict[str, str]) -> list[str]:
    """Lines of ``source`` that read or write ``os.environ`` (or call ``os.getenv``) with a key
    that is, or names a string constant that is, a ``VLLM_OMNI_EDGE_*`` name, or that use the
    prefix itself (filtering the environment by it). ``known``: constants other modules define."""
    tree = ast.parse(source)
    constants = {**known, **_constants(tree)}

    def ours(key: ast.AST | None) -> bool:
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            value = key.value
        elif isinstance(key, ast.Name):
            value = constants.get(key.id, "")
        elif isinstance(key, ast.Attribute):
            value = constants.get(key.attr, "")
        elif isinstance(key, ast.JoinedStr) and key.values and isinstance(key.values[0], ast.Constant):
            value = str(key.values[0].value)
        else:
            return False
        return value.startswith(envs.PREFIX)

    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Subscript) and _is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args and (
                _is_environ(node.func.value) or node.func.attr in ("getenv", "putenv", "unsetenv")):
            key = node.args[0]
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            key = node.left
        elif isinstance(node, ast.Constant) and node.value == envs.PREFIX:
            found.append(f"{node.lineno}: the {envs.PREFIX} prefix")
        if key is not None and ours(key):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_check_finds_each_way_of_reading_around_the_registry():
    source = '''
import os
ROPE = "VLLM_OMNI_EDGE_ROPE_CAP"
a = os.environ.get("VLLM_OMNI_EDGE_ROPE_CAP", "1")
b = os.environ[ROPE]
c = ROPE in os.environ
d = os.getenv(levers.SHM_SPIN_ENV)
os.environ[ROPE] = "0"
e = {k: v for k, v in os.environ.items() if k.startswith("VLLM_OMNI_EDGE_")}
f = (os.environ if environ is None else environ).get(ROPE, "")
g = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
'''
    found = environ_uses_of_ours(source, {"SHM_SPIN_ENV": "VLLM_OMNI_EDGE_SHM_SPIN_S"})
    assert sorted(int(line.split(":")[0]) for line in found) == [4, 5, 6, 7, 8, 9, 10], found


def test_no_module_reads_a_flag_of_ours_around_the_registry():
    modules = {path: path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}
    known: dict[str, str] = {}
    for source in modules.values():
        known.update({k: v for k, v in _constants(ast.parse(source)).items() if v.startswith(envs.PREFIX)})
    offenders = {str(path.relative_to(REPO)): found for path, source in modules.items()
                 if path.name != "envs.py" or path.parent != PACKAGE
                 for found in [environ_uses_of_ours(source, known)] if found}
    assert not offenders, f"read these through vllm_omni_edge/envs.py: {offenders}"


def test_every_flag_the_package_names_is_registered():
    named = set()
    for path in [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.yaml")]:
        named.update(re.findall(r"\bVLLM_OMNI_EDGE_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    assert named - set(envs.REGISTRY) - UNREGISTERED == set()
    assert UNREGISTERED <= named, f"no longer named anywhere: drop {UNREGISTERED - named} from UNREGISTERED"


# --- one cache root --------------------------------------------------------------------------


def test_everything_we_write_is_under_the_one_cache_root(isolated_cache):
    from vllm_omni_edge.quantization.kernels import native
    from vllm_omni_edge.stamped_memo import StampedMemo

    assert native.cache_dir() == isolated_cache / "kernels"
    assert StampedMemo("inductor", "x.json").path == isolated_cache / "inductor" / "x.json"
    for path in PACKAGE.rglob("*.py"):
        if path.name == "cache_paths.py":
            continue
        text = path.read_text()
        for other_root in ("user_cache_dir", "XDG_CACHE_HOME", '".cache"', "Path.home()"):
            assert other_root not in text, f"{path.relative_to(REPO)} names {other_root}: use cache_paths.cache_root()"


def test_doctor_names_a_bad_value_and_warns_of_a_flag_nothing_reads(monkeypatch):
    from vllm_omni_edge.cli.doctor import flag_checks

    for name in envs.snapshot():
        monkeypatch.delenv(name)
    assert [(c.ok, c.warning, c.detail) for c in flag_checks()] == [(True, False, "none set")]
    monkeypatch.setenv("VLLM_OMNI_EDGE_ROPE_CAP", "maybe")
    monkeypatch.setenv("VLLM_OMNI_EDGE_ROPECAP", "0")
    bad, unread = flag_checks()
    assert not bad.ok and "VLLM_OMNI_EDGE_ROPE_CAP='maybe': expected 1 (on) or 0 (off)" in bad.detail
    assert unread.ok and unread.warning and "VLLM_OMNI_EDGE_ROPECAP" in unread.detail
