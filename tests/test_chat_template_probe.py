"""chat_template_probe: no AutoProcessor load for a model directory that holds no processor."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from vllm_omni_edge.patches.frontend import chat_template_probe as patch


@pytest.fixture
def text_model(default_model, tmp_path):
    """A copy of the default model's small files (no weights needed to probe)."""
    for path in default_model.iterdir():
        if path.suffix in (".json", ".jinja"):
            shutil.copy(path, tmp_path / path.name)
    patch.cannot_hold_processor.cache_clear()
    yield tmp_path
    patch.cannot_hold_processor.cache_clear()


def test_the_default_model_is_skipped_and_vllm_finds_no_processor_either(default_model):
    from vllm.renderers.hf import _try_get_processor_chat_template

    assert patch.cannot_hold_processor(str(default_model))
    tokenizer = SimpleNamespace(name_or_path=str(default_model))
    original = getattr(_try_get_processor_chat_template, "__wrapped__", _try_get_processor_chat_template)
    assert original(tokenizer, revision=None, code_revision=None, trust_remote_code=False) is None


@pytest.mark.parametrize("make_processor", [
    lambda d: (d / "preprocessor_config.json").write_text("{}"),
    lambda d: (d / "processor_config.json").write_text("{}"),
    lambda d: (d / "video_preprocessor_config.json").write_text("{}"),
    lambda d: _update(d / "tokenizer_config.json", processor_class="LlavaProcessor"),
    lambda d: _update(d / "config.json", auto_map={"AutoProcessor": "x.Y"}),
    lambda d: _update(d / "config.json", model_type="qwen2_5_omni"),
], ids=["preprocessor", "processor", "video", "tokenizer-class", "config-auto-map", "model-type"])
def test_anything_that_can_define_a_processor_goes_to_vllm(text_model, make_processor):
    assert patch.cannot_hold_processor(str(text_model))
    patch.cannot_hold_processor.cache_clear()
    make_processor(text_model)
    assert not patch.cannot_hold_processor(str(text_model))


def _update(path, **fields):
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data))


def test_the_wrapper_skips_or_delegates(text_model):
    calls = []
    probe = patch.wrap_probe(lambda tokenizer, **kw: calls.append(tokenizer.name_or_path) or "template")
    assert probe(SimpleNamespace(name_or_path=str(text_model)), revision=None) is None
    assert probe(SimpleNamespace(name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct"), revision=None) == "template"
    assert calls == ["HuggingFaceTB/SmolLM2-135M-Instruct"]
