"""tokenizer_config: our checkpoints list their added tokens in tokenizer_config.json."""

from __future__ import annotations

import json

import pytest

from vllm_omni_edge.models.tokenizer_config import add_added_tokens

TEXT = "low lower <|im_end|> newer <pad>"


def _saved_tokenizer(directory):
    """A fast tokenizer with added and special tokens, saved as transformers 5 saves it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["[UNK]", "low", "lower", "new", "newer", "er"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="<|im_end|>")
    tokenizer.add_tokens(["<pad>"])
    tokenizer.save_pretrained(str(directory))
    return tokenizer


def _loaded_files(monkeypatch):
    import transformers.tokenization_utils_base as base

    names, original = [], base.json.load

    def load(fh, *args, **kwargs):
        names.append(getattr(fh, "name", "?").rsplit("/", 1)[-1])
        return original(fh, *args, **kwargs)

    monkeypatch.setattr(base.json, "load", load)
    return names


def test_the_same_tokenizer_loads_with_one_read_of_tokenizer_json(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    _saved_tokenizer(tmp_path / "a")
    assert "added_tokens_decoder" not in json.loads((tmp_path / "a" / "tokenizer_config.json").read_text())
    before = AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    assert add_added_tokens(tmp_path / "a")
    assert not add_added_tokens(tmp_path / "a")  # already there
    files = _loaded_files(monkeypatch)
    after = AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    assert "tokenizer.json" not in files  # the loader's own parse of the file only (not through this module)
    assert after(TEXT)["input_ids"] == before(TEXT)["input_ids"]
    assert after.added_tokens_decoder == before.added_tokens_decoder
    assert after.all_special_ids == before.all_special_ids and after.eos_token == "<|im_end|>"
    assert after.backend_tokenizer.to_str() == before.backend_tokenizer.to_str()


def test_without_the_entry_transformers_reads_tokenizer_json_again(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    _saved_tokenizer(tmp_path)
    files = _loaded_files(monkeypatch)
    AutoTokenizer.from_pretrained(str(tmp_path))
    assert "tokenizer.json" in files  # the control: the extra parse this module spares


def test_nothing_to_do_without_both_files(tmp_path):
    assert not add_added_tokens(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert not add_added_tokens(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text()) == {}


def test_a_damaged_tokenizer_json_is_an_error_and_the_config_is_untouched(tmp_path):
    _saved_tokenizer(tmp_path)
    config = (tmp_path / "tokenizer_config.json").read_text()
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(json.JSONDecodeError):
        add_added_tokens(tmp_path)
    assert (tmp_path / "tokenizer_config.json").read_text() == config
