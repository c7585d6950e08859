"""Which of vLLM's general plugins a process loads for the model it runs.

vLLM loads every ``vllm.general_plugins`` entry point in every process unless
``VLLM_PLUGINS`` names the ones to load. vLLM-Omni's (``register_omni_models_to_vllm``)
imports all of ``vllm_omni`` to register its architectures: time and resident memory for
nothing when the model is not one of them. So when the user has not set ``VLLM_PLUGINS``
and the model's ``config.json`` names no vLLM-Omni architecture, the servers
(``cli/vllm_entry.py``) and ``LLM()`` (``patches/frontend/omni_plugin_by_model.py``) load
every general plugin except vLLM-Omni's. Setting ``VLLM_PLUGINS`` yourself (to any list)
keeps vLLM's behaviour; so does a GGUF file, a missing ``config.json``, or a vLLM-Omni whose
registry we cannot read.
"""

from __future__ import annotations

import ast
import importlib.util
import json
from collections.abc import Mapping
from importlib.metadata import entry_points
from pathlib import Path

GENERAL_PLUGINS = "vllm.general_plugins"
OMNI_PACKAGE = "vllm_omni"
OMNI_REGISTRY = ("model_executor", "models", "registry.py")
OMNI_REGISTRY_TABLES = ("_OMNI_MODELS", "_VLLM_OMNI_MODELS")


def omni_architectures() -> frozenset[str] | None:
    """vLLM-Omni's registered architectures, read from its registry's source (not imported)."""
    spec = importlib.util.find_spec(OMNI_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations)), *OMNI_REGISTRY)
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return None
    names: set[str] = set()
    for node in tree.body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if any(isinstance(t, ast.Name) and t.id in OMNI_REGISTRY_TABLES for t in targets):
            if not isinstance(node.value, ast.Dict):
                return None
            names.update(k.value for k in node.value.keys if isinstance(k, ast.Constant))
    return frozenset(names) or None


def model_architectures(model: str) -> frozenset[str] | None:
    """The config's architectures; for a config without any (our GGUF conversions), its
    ``model_type`` when transformers knows it natively and it is not an omni type, else None."""
    config = Path(model).expanduser() / "config.json"
    try:
        fields = json.loads(config.read_text())
        architectures, model_type = fields.get("architectures"), fields.get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    if architectures:
        return frozenset(architectures)
    if not isinstance(model_type, str) or "omni" in model_type:
        return None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return frozenset({f"model_type:{model_type}"}) if model_type in CONFIG_MAPPING_NAMES else None


def plugins_without_omni() -> list[str]:
    return [ep.name for ep in entry_points(group=GENERAL_PLUGINS)
            if not ep.value.startswith(OMNI_PACKAGE + ".")]


def text_model_plugins(model: str, environ: Mapping[str, str]) -> str | None:
    """The ``VLLM_PLUGINS`` value to set for ``model``, or None to leave vLLM's default."""
    if "VLLM_PLUGINS" in environ:
        return None
    architectures = model_architectures(model)
    omni = omni_architectures()
    if architectures is None or omni is None or architectures & omni:
        return None
    return ",".join(plugins_without_omni())
