"""serve leaves vLLM-Omni's general plugin out only for models it does not register."""

from __future__ import annotations

import json

from vllm_omni_edge import plugin_selection


def model_dir(tmp_path, architectures):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": architectures}))
    return str(tmp_path)


def test_vllm_omnis_registry_is_read_without_importing_it():
    import subprocess
    import sys

    omni = plugin_selection.omni_architectures()
    assert omni and "Qwen2_5OmniForConditionalGeneration" in omni
    assert "LlamaForCausalLM" not in omni
    # In a fresh interpreter: reading the registry must not import vllm_omni (1.5 s).
    check = ("import sys; from vllm_omni_edge.plugin_selection import omni_architectures; "
             "assert omni_architectures(); print('vllm_omni' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_a_text_model_loads_every_general_plugin_but_vllm_omnis(tmp_path):
    plugins = plugin_selection.text_model_plugins(model_dir(tmp_path, ["LlamaForCausalLM"]), {})
    names = plugins.split(",")
    assert "vllm_omni_edge" in names
    assert "vllm_omni_register_models" not in names
    assert set(names) == {ep.name for ep in plugin_selection.entry_points(group="vllm.general_plugins")
                          if ep.name != "vllm_omni_register_models"}


def test_vllms_default_stays_for_omni_models_user_choices_and_unknowns(tmp_path):
    omni = model_dir(tmp_path, ["Qwen2_5OmniForConditionalGeneration"])
    assert plugin_selection.text_model_plugins(omni, {}) is None
    text = tmp_path / "text"
    text.mkdir()
    text_model = model_dir(text, ["LlamaForCausalLM"])
    assert plugin_selection.text_model_plugins(text_model, {"VLLM_PLUGINS": "x"}) is None
    assert plugin_selection.text_model_plugins(str(tmp_path / "model.gguf"), {}) is None
    assert plugin_selection.text_model_plugins(str(tmp_path / "missing"), {}) is None


def test_an_unreadable_registry_keeps_vllms_default(tmp_path, monkeypatch):
    monkeypatch.setattr(plugin_selection, "OMNI_REGISTRY", ("nowhere.py",))
    assert plugin_selection.omni_architectures() is None
    assert plugin_selection.text_model_plugins(model_dir(tmp_path, ["LlamaForCausalLM"]), {}) is None


def test_a_config_without_architectures_goes_by_its_model_type(tmp_path):
    def config(path, fields):
        path.mkdir()
        (path / "config.json").write_text(json.dumps(fields))
        return str(path)

    llama = config(tmp_path / "llama", {"model_type": "llama"})  # what our GGUF conversion writes
    assert plugin_selection.text_model_plugins(llama, {}) is not None
    omni = config(tmp_path / "omni", {"model_type": "qwen2_5_omni"})
    assert plugin_selection.text_model_plugins(omni, {}) is None
    custom = config(tmp_path / "custom", {"model_type": "indextts2"})
    assert plugin_selection.text_model_plugins(custom, {}) is None


# --- LLM(): the EngineArgs wrapper (patches/frontend/omni_plugin_by_model.py) ---

class _Args:
    def __init__(self, model):
        self.model = model
        self.seen = None


def _wrapped(seen_env):
    from vllm_omni_edge.patches.frontend import omni_plugin_by_model

    def original(self):
        self.seen = seen_env.get("VLLM_PLUGINS")

    return omni_plugin_by_model._make_post_init(original)


def test_llm_args_load_plugins_without_vllm_omnis_and_put_the_environment_back(tmp_path, monkeypatch):
    import os

    import vllm.plugins

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.delitem(__import__("sys").modules, "vllm_omni", raising=False)
    args = _Args(model_dir(tmp_path, ["LlamaForCausalLM"]))
    _wrapped(os.environ)(args)
    assert args.seen == plugin_selection.text_model_plugins(args.model, {})
    assert "vllm_omni_register_models" not in args.seen.split(",")
    assert "VLLM_PLUGINS" not in os.environ


def test_llm_args_keep_vllms_choice_when_it_is_not_ours_to_make(tmp_path, monkeypatch):
    import os
    import sys
    import types

    import vllm.plugins

    text = model_dir(tmp_path, ["LlamaForCausalLM"])
    post_init = _wrapped(os.environ)
    monkeypatch.delitem(sys.modules, "vllm_omni", raising=False)
    # the user's value
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.setenv("VLLM_PLUGINS", "mine")
    args = _Args(text)
    post_init(args)
    assert args.seen == "mine" and os.environ["VLLM_PLUGINS"] == "mine"
    monkeypatch.delenv("VLLM_PLUGINS")
    # plugins already loaded in this process
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", True)
    post_init(args)
    assert args.seen is None
    # a vLLM-Omni process (its stages may be any model)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.setitem(sys.modules, "vllm_omni", types.ModuleType("vllm_omni"))
    post_init(args)
    assert args.seen is None
    monkeypatch.delitem(sys.modules, "vllm_omni")
    # an omni architecture
    omni = tmp_path / "omni"
    omni.mkdir()
    args = _Args(model_dir(omni, ["Qwen2_5OmniForConditionalGeneration"]))
    post_init(args)
    assert args.seen is None


def test_a_fresh_engine_args_for_a_text_model_leaves_vllm_omni_unimported(tmp_path):
    import subprocess
    import sys

    text = model_dir(tmp_path, ["LlamaForCausalLM"])
    check = ("import os, sys\n"
             "from vllm_omni_edge.patches.early import install_interpreter_hooks\n"
             "install_interpreter_hooks()\n"
             "import vllm.plugins\n"
             "from vllm.engine.arg_utils import EngineArgs\n"
             f"try:\n    EngineArgs(model={text!r})\nexcept Exception:\n    pass\n"
             "print(vllm.plugins.plugins_loaded, 'vllm_omni' in sys.modules, "
             "'vllm_omni_edge.plugin' in sys.modules, os.environ.get('VLLM_PLUGINS'))\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "VLLM_PLUGINS"}
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env, timeout=300)
    assert out.stdout.strip().splitlines()[-1:] == ["True False True None"], out.stderr[-3000:]


# --- servers: cli/vllm_entry.py ---

def test_a_server_for_a_text_model_names_the_plugins_it_loads(tmp_path, monkeypatch, capsys):
    import os

    from vllm_omni_edge.cli.vllm_entry import select_plugins

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    text = model_dir(tmp_path, ["LlamaForCausalLM"])
    select_plugins([text, "--port", "8000"], "vllm serve")
    assert os.environ["VLLM_PLUGINS"] == plugin_selection.text_model_plugins(text, {})
    assert "vllm serve: VLLM_PLUGINS=" in capsys.readouterr().err
    monkeypatch.setenv("VLLM_PLUGINS", "mine")
    select_plugins([text], "vllm serve")
    assert os.environ["VLLM_PLUGINS"] == "mine"
    monkeypatch.delenv("VLLM_PLUGINS")
    omni = tmp_path / "omni"
    omni.mkdir()
    select_plugins(["--model", model_dir(omni, ["Qwen2_5OmniForConditionalGeneration"])], "vllm serve")
    assert "VLLM_PLUGINS" not in os.environ
