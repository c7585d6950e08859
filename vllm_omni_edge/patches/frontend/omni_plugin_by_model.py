"""``LLM()`` leaves vLLM-Omni's general plugin out when the model is not a vLLM-Omni architecture.

What: wraps ``vllm.engine.arg_utils.EngineArgs.__post_init__``, where vLLM first loads its
general plugins for ``LLM()``. When no plugin is loaded yet in this process, ``vllm_omni``
is not imported (a vLLM-Omni pipeline's process keeps vLLM's default), the user has not set
``VLLM_PLUGINS``, and the model's ``config.json`` names no architecture vLLM-Omni
registers (``plugin_selection.text_model_plugins``), ``VLLM_PLUGINS`` lists every general
plugin but vLLM-Omni's while the arguments are built, and is put back afterwards. The
servers make the same choice from their command line (``cli/vllm_entry.py``), before
vLLM's argument parser loads the plugins.
Why: vLLM-Omni's plugin imports the whole ``vllm_omni`` package (its patches, configs,
metrics and model registry) into every process that loads vLLM, to register
architectures a text or Whisper model never resolves.
Installed at interpreter start (``patches/early.py``): the plugins load inside the call it
wraps, before our own general plugin could install it.
Flag: none of ours; ``VLLM_PLUGINS`` set by the user (any value) keeps vLLM's behaviour.
Verified by: tests/test_plugin_selection.py (the choice per model, the environment put
back, the user's value kept; a fresh ``LLM()`` on a text model leaves ``vllm_omni``
unimported and answers); tests/omni (vLLM-Omni pipelines still load it).
Remove when: vLLM-Omni registers its architectures without importing its package.
"""

from __future__ import annotations

import os

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.engine.arg_utils"
PLUGINS_ENV = "VLLM_PLUGINS"
OMNI_PACKAGE = "vllm_omni"

RECORD = PatchRecord(
    name="omni_plugin_by_model",
    kind=Kind.LEVER,
    target=f"{TARGET_MODULE}.EngineArgs.__post_init__ (VLLM_PLUGINS while general plugins load)",
    process=Process.FRONTEND,
    why="vLLM-Omni's general plugin imports all of vllm_omni in every process that loads vLLM, "
    "to register architectures a text or Whisper model never resolves.",
    verified_by="tests/test_plugin_selection.py (choice per model, environment restored, the "
    "user's VLLM_PLUGINS kept, LLM() on a text model without vllm_omni); tests/omni. PSS_Anon "
    "SmolLM2 LLM() -18 MiB, server -16 MiB (results/2026-12-04-memory-omni-plugin-epyc); Qwen "
    "LLM() -15 MiB (results/2026-12-04-memory-levers-qwen-epyc).",
    remove_when="vLLM-Omni registers its architectures lazily, without importing its package.",
    upstream="none found",
)


def apply() -> str:
    now = when_imported(TARGET_MODULE, _wrap)
    return "vLLM-Omni's plugin only for its own architectures" + ("" if now else " (on import)")


def _wrap(module) -> None:
    """Installed at interpreter start, before a version check could import vLLM: checked here."""
    from vllm.version import __version__

    if __version__ not in RECORD.vllm_versions:
        from vllm_omni_edge.log import get_logger

        get_logger("omni_plugin_by_model").warning(
            "not applying patch omni_plugin_by_model: vllm %s is not one of %s", __version__,
            RECORD.vllm_versions)
        return
    wrap_method_once(module.EngineArgs, "__post_init__", _make_post_init)


def _make_post_init(original):
    def __post_init__(self, *args, **kwargs):
        plugins = _plugins_for(getattr(self, "model", None))
        if plugins is None:
            return original(self, *args, **kwargs)
        os.environ[PLUGINS_ENV] = plugins
        try:
            return original(self, *args, **kwargs)
        finally:
            if os.environ.get(PLUGINS_ENV) == plugins:
                del os.environ[PLUGINS_ENV]

    return __post_init__


def _plugins_for(model) -> str | None:
    """The ``VLLM_PLUGINS`` value for loading plugins now, or None to leave vLLM's choice."""
    import sys

    import vllm.plugins

    if vllm.plugins.plugins_loaded or not model or OMNI_PACKAGE in sys.modules:
        return None  # loaded already, or a vLLM-Omni process (its stages may be any model)
    from vllm_omni_edge.plugin_selection import text_model_plugins

    return text_model_plugins(str(model), os.environ)
