"""Baselines we are measured against: llama.cpp (through llama-cpp-python).

``llamacpp`` loads a GGUF and records what llama.cpp really used (buffer types,
compiled CPU features); ``llamacpp_quantize`` builds llama.cpp's files from the
same bf16 checkpoint our cpu_int4 is built from. See docs/edge/comparisons.md.
"""
