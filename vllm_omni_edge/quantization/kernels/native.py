"""Our C++ kernels: built once per machine (``vllm-omni-edge build-kernels``, run by
``scripts/setup.sh``), loaded by every process that quantizes.

A library is named after the hash of its source, the compile flags and the torch
version, so a stale build is never loaded: an edited source or a new torch means
"not built" until the next build. Loading never compiles (a worker must not
spend a minute in g++ during model load); a kernel whose library is missing
says so in its ``can_implement`` reason and the chooser moves on, and the
process's kernel summary warns (``quantization/evidence.py``). Our own front
ends (``vllm-omni-edge serve``, ``demo``) build a missing library before they
start a server (``build_if_missing``), saying so.

The build goes through ``torch.utils.cpp_extension`` (ninja, the g++ torch was
built for) into a temporary directory, and the finished ``.so`` is moved into
place atomically: a crashed build leaves nothing that looks built.
"""

from __future__ import annotations

import functools
import hashlib
import platform
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_omni_edge.atomic import atomic_write_bytes
from vllm_omni_edge.cache_paths import cache_root

CSRC = Path(__file__).parent / "csrc"
# One library. The op namespace edge_cpu_int4: the AVX2 W4A8 ops, and the AVX-512 VNNI ops
# (16-row layout, bf16 prefill, fused MLP) whose functions carry their own target attribute.
# The namespace edge_cpu: decode attention over vLLM's CPU KV cache, a row-wise argmax
# for the sampler (AVX2, F16C), and the class DecoderStack, a llama-family decoder's layers for
# one-token queries in one call, and the fold of a 6-bit layer to 4 bits at load.
SOURCES = (CSRC / "w4a8_avx2.cpp", CSRC / "w4a8_avx512.cpp", CSRC / "decode_attention.cpp", CSRC / "argmax.cpp",
           CSRC / "decoder_stack.cpp", CSRC / "embedding_rows.cpp", CSRC / "fold_6bit.cpp")
HEADERS = (CSRC / "w4a8_common.h", CSRC / "convert8.h", CSRC / "avx2_math.h")
# -fopenmp: at::parallel_for is OpenMP inline in the headers; without it the
# kernel runs on one thread whatever torch.set_num_threads says. The runtime is
# torch's own libgomp (same soname, already loaded), so thread counts are shared.
BASE_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp")
OP_NAMESPACE = "edge_cpu_int4"
# oneDNN's own library (the onednn-cpu-gomp wheel, GNU OpenMP: torch's libgomp again) and its
# headers (onednn-devel-cpu-gomp): the rows16 prefill calls its matmul on weights dequantized into
# the primitive's own layout. Without them the library builds without that path (at::mm only).
ONEDNN_DISTRIBUTIONS = ("onednn-cpu-gomp", "onednn-devel-cpu-gomp")


@dataclass(frozen=True)
class OneDnn:
    include_dir: Path
    lib_dir: Path


@functools.cache
def onednn() -> OneDnn | None:
    """Where the oneDNN wheels put the headers and libdnnl.so.3, or None if either is missing."""
    from importlib import metadata

    def installed(name: str, file_name: str) -> Path | None:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            return None
        found = [f for f in dist.files or [] if f.name == file_name]
        return Path(dist.locate_file(found[0])).resolve() if found else None

    lib = installed(ONEDNN_DISTRIBUTIONS[0], "libdnnl.so.3")
    header = installed(ONEDNN_DISTRIBUTIONS[1], "dnnl.hpp")
    if lib is None or header is None or not lib.exists() or not header.exists():
        return None
    # The header the sources include is oneapi/dnnl/dnnl.hpp.
    include = header.parent.parent.parent if header.parent.name == "dnnl" else header.parent
    return OneDnn(include_dir=include, lib_dir=lib.parent)


def compile_flags() -> tuple[str, ...]:
    found = onednn()
    return BASE_FLAGS + (("-DEDGE_ONEDNN", f"-I{found.include_dir}") if found else ())


def link_flags() -> list[str]:
    found = onednn()
    extra = [f"-L{found.lib_dir}", "-l:libdnnl.so.3", f"-Wl,-rpath,{found.lib_dir}"] if found else []
    return ["-fopenmp", *extra]


class KernelBuildError(RuntimeError):
    """The C++ kernel could not be compiled on this machine."""


def cache_dir() -> Path:
    return cache_root() / "kernels"


def library_path(files: tuple[Path, ...] = SOURCES + HEADERS, flags: tuple[str, ...] | None = None) -> Path:
    if flags is None:
        flags = compile_flags() + tuple(link_flags())
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(" ".join(flags).encode())
    digest.update(torch.__version__.encode())
    return cache_dir() / f"{OP_NAMESPACE}-{digest.hexdigest()[:16]}.so"


def x86_64() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


def build_library(verbose: bool = False) -> Path:
    """Compile the kernel library if these sources/torch have none yet; its path."""
    target = library_path()
    if target.exists():
        return target
    if not x86_64():
        raise KernelBuildError(f"the W4A8 kernels are x86-64 only; this machine is {platform.machine()}")
    from torch.utils import cpp_extension

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as build:
        name = target.stem.replace("-", "_")
        try:
            cpp_extension.load(
                name=name,
                sources=[str(s) for s in SOURCES],
                extra_cflags=list(compile_flags()),
                extra_ldflags=link_flags(),
                build_directory=build,
                is_python_module=False,
                is_standalone=False,
                verbose=verbose,
            )
        except Exception as e:  # compiler missing, headers missing, a compile error
            raise KernelBuildError(f"building {', '.join(s.name for s in SOURCES)} failed: {e}") from e
        built = Path(build) / f"{name}.so"
        if not built.exists():
            raise KernelBuildError(f"the build wrote no {built.name} in {build}")
        atomic_write_bytes(target, built.read_bytes())
    return target


def build_if_missing(say) -> bool:
    """Before a front end starts an engine: build the library if this source and torch have none.

    ``say`` gets one line before a build and one after it (or why it failed: the engine then
    runs on the fallback kernels and warns). True when the library exists afterwards."""
    if not x86_64():
        return False
    target = library_path()
    if target.exists():
        return True
    say("building the C++ kernels for this source and torch (once per machine, about a minute "
        "on 2 cores; `vllm-omni-edge build-kernels` does the same)")
    try:
        build_library()
    except KernelBuildError as e:
        say(f"warning: the C++ kernels did not build ({e}); cpu_int4 runs on its slower fallback kernels")
        return False
    say(f"built {target.name}")
    return True


NOT_BUILT = "not built for this source"


@functools.cache
def load_library() -> tuple[bool, str]:
    """(loaded, why not): load the built library into this process, once."""
    if hasattr(getattr(torch.ops, OP_NAMESPACE), "w4a8_mm"):  # namespaces exist lazily
        return True, "loaded"
    if not x86_64():
        return False, f"x86-64 only (this machine is {platform.machine()})"
    path = library_path()
    if not path.exists():
        return False, f"{NOT_BUILT} and torch {torch.__version__}: run `vllm-omni-edge build-kernels`"
    try:
        torch.ops.load_library(str(path))
    except Exception as e:
        return False, f"{path.name} did not load: {e}"
    _register_fake()
    return True, f"loaded {path.name}"


def edge_cpu_op(name: str):
    """The op ``edge_cpu::<name>`` of our library, or None when it is not built or does not load here."""
    loaded, _ = load_library()
    return getattr(torch.ops.edge_cpu, name).default if loaded else None


def _register_fake() -> None:
    """Shape-only implementation, so torch.compile can trace through the op."""

    def output_shape(x, qweight, scales, offsets, group_size, factors=None, high_bits=None):
        return x.new_empty((x.shape[0], qweight.shape[0]))

    for op in ("w4a8_mm", "w4a8_avx2_rows8_mm", "w4a8_vnni_rows16_mm"):
        torch.library.register_fake(f"{OP_NAMESPACE}::{op}")(output_shape)

    def mlp_output_shape(x, gate_up_qweight, gate_up_scales, gate_up_offsets, gate_up_group_size,
                         down_qweight, down_scales, down_offsets, down_group_size,
                         gate_up_factors=None, down_factors=None, gate_up_high_bits=None, down_high_bits=None):
        return x.new_empty((x.shape[0], down_qweight.shape[0]))

    torch.library.register_fake(f"{OP_NAMESPACE}::w4a8_vnni_rows16_silu_mlp")(mlp_output_shape)
