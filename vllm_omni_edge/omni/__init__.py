"""vLLM-Omni helpers: tiny checkpoints of multi-stage architectures for tests and the harness."""
