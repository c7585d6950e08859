"""``vllm-omni-edge serve`` with an engine fault a test can trigger.

    python tests/e2e/fault_injected_serve.py <serve arguments>

Once the file named by ``EDGE_TEST_FAULT_FILE`` exists, the model step
(``UniProcExecutor.execute_model``) raises. In the single-process layout there is
no worker process to kill, so this is how a test makes the engine die in the
middle of serving. The fault lives here, in the test, not in the product.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

FAULT_FILE_ENV = "EDGE_TEST_FAULT_FILE"
FAULT_MESSAGE = "fault injected by the test"


def _inject(module) -> None:
    trigger = Path(os.environ[FAULT_FILE_ENV])
    original = module.UniProcExecutor.execute_model

    def execute_model(self, *args, **kwargs):
        if trigger.exists():
            raise RuntimeError(f"{FAULT_MESSAGE} ({trigger} exists)")
        return original(self, *args, **kwargs)

    module.UniProcExecutor.execute_model = execute_model


if __name__ == "__main__":
    from vllm_omni_edge.cli.main import main
    from vllm_omni_edge.patches.import_hook import when_imported

    when_imported("vllm.v1.executor.uniproc_executor", _inject)
    sys.exit(main(["serve", *sys.argv[1:]]))
