"""front_end_thread_count: vLLM's front-end thread counts no longer trip the CPU worker's guard warning."""

from __future__ import annotations

import logging

import pytest

from vllm_omni_edge.patches.worker import front_end_thread_count as patch

GUARD_TEXT = ("CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, "
              "skip it.")


@pytest.fixture
def guarded(monkeypatch, caplog):
    """The CPU worker's logger with our filter, and torch.set_num_threads replaced as
    CPUWorker.init_device replaces it (the same message, through the same logger)."""
    import torch

    logger = logging.getLogger(patch.LOGGER)
    monkeypatch.setattr(logger, "filters", [])
    monkeypatch.setattr(logger, "handlers", [caplog.handler])
    monkeypatch.setattr(logger, "propagate", False)
    monkeypatch.setattr(logger, "disabled", False)
    caplog.set_level(logging.INFO, logger=patch.LOGGER)
    patch.apply()
    patch.apply()  # idempotent
    assert sum(isinstance(f, patch.FrontEndThreadCountFilter) for f in logger.filters) == 1

    def skip_set_num_threads(x: int):
        logger.warning(GUARD_TEXT)

    monkeypatch.setattr(torch, "set_num_threads", skip_set_num_threads)
    return logger


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_vllms_front_end_thread_count_is_skipped_without_a_warning(guarded, caplog):
    from vllm.utils.torch_utils import set_default_torch_num_threads

    with set_default_torch_num_threads(1):
        pass
    assert _warnings(caplog) == []


def test_a_direct_call_still_warns(guarded, caplog):
    import torch

    torch.set_num_threads(1)
    assert _warnings(caplog) == [GUARD_TEXT]


def test_other_records_of_that_logger_pass(guarded, caplog):
    from vllm.utils.torch_utils import set_default_torch_num_threads

    with set_default_torch_num_threads(1):
        guarded.warning("libtcmalloc is not found in LD_PRELOAD.")
    assert _warnings(caplog) == ["libtcmalloc is not found in LD_PRELOAD."]


def test_the_plugin_installs_it():
    from vllm_omni_edge.patches import PLUGIN_PATCHES

    assert "vllm_omni_edge.patches.worker.front_end_thread_count" in PLUGIN_PATCHES
