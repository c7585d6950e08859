"""Entry points vLLM calls: ``vllm.general_plugins`` runs in every vLLM process."""

from __future__ import annotations

from vllm_omni_edge.log import get_logger

logger = get_logger("plugin")


def register_general_plugin() -> None:
    """Apply our patches in this process; vLLM calls this once per process."""
    from vllm_omni_edge import envs
    from vllm_omni_edge.evidence import write_process_record
    from vllm_omni_edge.patches import apply_plugin_patches

    results = apply_plugin_patches()
    failed = [o for o in results.values() if o.status == "failed"]
    logger.info(
        "vllm-omni-edge: %d patches applied, %d skipped, %d failed",
        sum(o.status == "applied" for o in results.values()),
        sum(o.status == "skipped-version" for o in results.values()),
        len(failed),
    )
    write_process_record()
    if unread := envs.unknown():
        logger.warning("vllm-omni-edge: %s set, but nothing reads it (the flags: docs/edge/flags.md)",
                       ", ".join(unread))
