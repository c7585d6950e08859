"""CPU workers and model runners for vLLM-Omni's AR and generation stages (XPU's pattern)."""
