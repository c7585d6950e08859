"""serve leaves vLLM-Omni's general plugin out only for models it does not register."""

from __future__ import annotations

import json

from vllm_omni_edge.cli import plugin_selection


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
    check = ("import sys; from vllm_omni_edge.cli.plugin_selection import omni_architectures; "
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
