"""Where vllm-omni-edge keeps what it builds: models, GGUFs, probe results."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "VLLM_OMNI_EDGE_CACHE"


def cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("vllm-omni-edge"))
