"""``vllm-omni serve MODEL --omni`` as a test fixture: start, wait for /health, inspect, stop."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.conftest import vllm_env
from vllm_omni_edge.cli.demo import free_port, stop_process_group


class OmniServer:
    """``vllm-omni serve MODEL --omni`` in its own session, stopped as a group."""

    def __init__(self, model: Path, log_path: Path, *extra_args: str, init_timeout_s: int = 1500):
        self.port = free_port()
        self.log_path = log_path
        self._log = open(log_path, "wb")
        cmd = [str(Path(sys.executable).parent / "vllm-omni"), "serve", str(model), "--omni",
               "--host", "127.0.0.1", "--port", str(self.port),
               "--stage-init-timeout", str(init_timeout_s), "--init-timeout", str(init_timeout_s + 900),
               *extra_args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=vllm_env())
        self.base_url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float) -> None:
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(1)
        raise TimeoutError(f"server not ready after {timeout_s:.0f} s:\n{self.tail()}")

    def health(self) -> int | None:
        """/health's status code, or None when nothing answers."""
        try:
            return httpx.get(self.base_url + "/health", timeout=5).status_code
        except httpx.HTTPError:
            return None

    def model_name(self) -> str:
        return httpx.get(self.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]

    def tail(self, lines: int = 60) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> int | None:
        returncode = stop_process_group(self.proc)
        self._log.close()
        return returncode
