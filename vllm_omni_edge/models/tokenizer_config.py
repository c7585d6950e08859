"""A checkpoint's ``tokenizer_config.json`` lists its added tokens, so a load reads ``tokenizer.json`` once.

transformers 5 saves a fast tokenizer's config without ``added_tokens_decoder`` (the tokens are in
``tokenizer.json``), and its loader then parses the whole ``tokenizer.json`` an extra time to find
them (its legacy branch), before the parse that builds the tokenizer: for a large vocabulary such
as Qwen2.5's, a visible part of every start. Written here into the checkpoints we make (a GGUF's
conversion, cpu_int4 builds): the same entries the legacy branch reads, so the loaded tokenizer is
the same.
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_omni_edge.atomic import atomic_write_bytes

CONFIG = "tokenizer_config.json"
TOKENIZER = "tokenizer.json"
KEY = "added_tokens_decoder"


def add_added_tokens(directory: Path) -> bool:
    """Write ``tokenizer.json``'s added tokens into ``tokenizer_config.json``; True if it did.

    Nothing to do when the config has them, or either file is missing.
    """
    directory = Path(directory)
    config_path, tokenizer_path = directory / CONFIG, directory / TOKENIZER
    if not config_path.is_file() or not tokenizer_path.is_file():
        return False
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if KEY in config:
        return False
    added = json.loads(tokenizer_path.read_text(encoding="utf-8")).get("added_tokens") or []
    decoder = {}
    for token in added:
        entry = dict(token)
        decoder[str(entry.pop("id"))] = entry
    config[KEY] = decoder
    atomic_write_bytes(config_path, (json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode())
    return True
