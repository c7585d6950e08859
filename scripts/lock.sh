#!/usr/bin/env bash
# Re-resolve requirements/lock.txt in a scratch venv (needs the registry).
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install --quiet torch==2.13.0 -e ".[test]"
{
  sed -n '1,5p' requirements/lock.txt
  "$tmp/venv/bin/pip" freeze --exclude-editable \
    | grep -v -i -E '^(torchaudio|torchcodec|vllm-omni-edge)[=@ ]'
} > requirements/lock.txt.new
mv requirements/lock.txt.new requirements/lock.txt
rm -rf "$tmp"
