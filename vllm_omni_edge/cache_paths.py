"""The one directory vllm-omni-edge writes what it builds and remembers under.

``VLLM_OMNI_EDGE_CACHE`` moves it; unset, it is the user cache directory (platformdirs:
``~/.cache/vllm-omni-edge`` on Linux, ``$XDG_CACHE_HOME/vllm-omni-edge`` when that is set).
Its subdirectories:

- ``models/``: checkpoints built from the embedded models (bf16, ``cpu_int4``, Whisper);
- ``gguf/``: the embedded GGUFs, and ``gguf/served/`` the checkpoints built from a user's GGUF;
- ``ct2/``: the joined CTranslate2 Whisper model;
- ``kernels/``: our C++ kernel libraries (``vllm-omni-edge build-kernels``);
- ``inductor/``: inductor's ISA probes and precompiled-header paths, remembered across starts;
- ``verified-weights/``: the cpu_int4 checkpoints' SHA-256 checks, one record per file version;
- ``omni/`` and ``deploy/``: vLLM-Omni stage configurations written for a model.

vLLM's own compile cache stays where vLLM puts it (``VLLM_CACHE_ROOT``).
"""

from __future__ import annotations

from pathlib import Path

from vllm_omni_edge import envs

CACHE_ENV = "VLLM_OMNI_EDGE_CACHE"


def cache_root() -> Path:
    root = envs.get(CACHE_ENV)
    if root is not None:
        return root
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("vllm-omni-edge"))
