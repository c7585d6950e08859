"""Loggers under vLLM's ``vllm`` logger, so our lines show with vLLM's format and level."""

import logging


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(f"vllm.omni_edge.{name}")
