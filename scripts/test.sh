#!/usr/bin/env bash
# Set up everything, then run the tests. Extra arguments go to pytest.
#   scripts/test.sh              # CI's run: all but the `slow` tests
#   EDGE_TESTS=fast scripts/test.sh   # unit tests only (no vLLM engine), ~1 min
#   EDGE_TESTS=all scripts/test.sh    # everything, including long runs
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --bench  # the harness's tests need its baselines
case "${EDGE_TESTS:-default}" in
  fast) marks="not e2e and not slow" ;;
  all) marks="" ;;
  *) marks="not slow" ;;
esac
.venv/bin/python -m pytest ${marks:+-m "$marks"} "$@"
