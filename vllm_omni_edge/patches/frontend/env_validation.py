"""vLLM's check of ``VLLM_*`` environment variables knows ours.

What: wraps ``vllm.envs.validate_environ`` (called by ``EngineArgs.create_engine_config``
for ``LLM()`` and the server). Variables declared in ``vllm_omni_edge/envs.py`` count as
known; every other ``VLLM_*`` variable vLLM does not know is reported as vLLM reports it (a
warning, or ``ValueError`` with ``fail_on_environ_validation``). An undeclared
``VLLM_OMNI_EDGE_*`` name (a typo, a removed flag) is reported the same way, and its message
adds that it is not one of our flags and where they are listed. When the environment holds
none of our variables, vLLM's own function runs.
Why: vLLM knows only its own names. Our reserved_cores patch sets an internal marker of ours
in every front end, so every ``LLM()`` and ``vllm serve`` logged "Unknown vLLM environment
variable detected", each of our documented flags a user set did too, and with vLLM's
``fail_on_environ_validation=True`` every start died with ``ValueError`` before the engine
was built.
Verified by: tests/test_env_validation.py (vLLM's own results for environments without our
variables, ours accepted, an undeclared ``VLLM_OMNI_EDGE_*`` name warned or refused with the
hint, vLLM's unknown names still refused beside ours, idempotent); ``LLM(...,
fail_on_environ_validation=True)`` starts with our flags set (the e2e test there).
Remove when: vLLM lets a plugin declare its environment variables (or skips a plugin's prefix).
"""

from __future__ import annotations

import os

from vllm_omni_edge import envs
from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.envs"

RECORD = PatchRecord(
    name="env_validation",
    kind=Kind.FIX,
    target=f"{TARGET_MODULE}.validate_environ",
    process=Process.FRONTEND,  # where EngineArgs builds the config
    why="vLLM's environment check does not know our VLLM_OMNI_EDGE_* variables: a warning at every "
    "start (our reserved_cores marker), and fail_on_environ_validation=True refused every start.",
    verified_by="tests/test_env_validation.py (its e2e test: "
    "LLM() with fail_on_environ_validation=True starts).",
    remove_when="vLLM lets a plugin declare its environment variables.",
    upstream="none found",
)

HINT = "; it is not a vllm-omni-edge flag either (`vllm-omni-edge flags` lists them)"


def unknown_names(known_to_vllm, environ=None) -> list[str]:
    """``VLLM_*`` names set that neither vLLM nor we declare, in the environment's order."""
    environ = os.environ if environ is None else environ
    return [name for name in environ
            if name.startswith("VLLM_") and name not in known_to_vllm and name not in envs.REGISTRY]


def _wrap(module) -> None:
    def make(original):
        def validate_environ(hard_fail: bool) -> None:
            if not envs.snapshot():
                return original(hard_fail)
            for name in unknown_names(module.environment_variables):
                message = f"Unknown vLLM environment variable detected: {name}"
                if name.startswith(envs.PREFIX):
                    message += HINT
                if hard_fail:
                    raise ValueError(message)
                module.logger.warning(message)

        return validate_environ

    wrap_method_once(module, "validate_environ", make)  # a module attribute, not a method


def apply() -> str:
    now = when_imported(TARGET_MODULE, _wrap)
    return "vLLM's environment check knows our flags" + ("" if now else " (on import)")
