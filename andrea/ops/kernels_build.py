"""Kernel sources and their NVRTC build: `kernels/<op>.cu` per op pair with kernels, plus `common.cuh`.

The CUDA engine loads these sources through `cupy.RawModule`; `compile_kernels` builds them for any
architecture with NVRTC alone (no GPU needed), which is how CI checks that every kernel compiles.
The folder is the repository's `kernels/`, or the one named by the environment variable
ANDREA_KERNELS.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from andrea.common.atomic import atomic_write
from andrea.common.errors import AndreaError
from andrea.spec.precision import PRECISIONS

# The op pairs with kernels of their own. One made only of matrix products has no file: cuBLAS runs attn_out (W_O)
# whole, from andrea/ops/attn_out.py; attn_qkv's file holds only the copy of W_QKV its backward reads.
KERNEL_FILES = ("embed", "layernorm", "attn_qkv", "attn", "attn_bf16", "mlp", "residual_add", "loss", "grad_norm", "adamw",
                "fp8", "memset")
COMMON_HEADER = "common.cuh"
ARCHS = ("sm_80", "sm_89", "sm_90")
# Hopper's own build of the files that have one (andrea.ops.hopper_kernel_files): the architecture-specific
# target sm_90a (its warpgroup products, wgmma), whose code runs on compute capability 9.0 only. Off with
# ANDREA_WGMMA=0.
HOPPER_ARCH = "sm_90a"
NVRTC_OPTIONS = ("-std=c++17",)
# Each precision is its own build of the same sources: the activation type act_t (common.cuh).
BUILDS = {name: p.build_defines for name, p in PRECISIONS.items()}


def build_options(precision: str) -> tuple[str, ...]:
    return (*NVRTC_OPTIONS, *BUILDS[precision])


def kernel_dir() -> Path:
    env = os.environ.get("ANDREA_KERNELS")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "kernels"
    if not (path / COMMON_HEADER).is_file():
        raise AndreaError(f"{path}: no CUDA kernel folder here (missing {COMMON_HEADER}); "
                          "set ANDREA_KERNELS to the repository's kernels/ folder")
    return path


def kernel_source(op: str, folder: Path | None = None) -> str:
    """The source of kernels/<op>.cu with common.cuh spliced in, so the text alone decides the build
    (CuPy caches compiled modules by source text; an edit to the header must change it)."""
    folder = folder or kernel_dir()
    path = folder / f"{op}.cu"
    if not path.is_file():
        raise AndreaError(f"{path}: kernel file not found; expected one of {', '.join(KERNEL_FILES)}")
    header = (folder / COMMON_HEADER).read_text()
    include = f'#include "{COMMON_HEADER}"'
    return path.read_text().replace(include, f"// ---- {COMMON_HEADER} ----\n{header}// ---- end {COMMON_HEADER} ----", 1)


def cuda_include_dir() -> str:
    """Folder with the CUDA runtime headers (cuda_bf16.h and friends), from the cudart wheel."""
    from cuda import pathfinder

    found = pathfinder.find_nvidia_header_directory("cudart")
    if not found:
        raise AndreaError("CUDA headers not found; install the kernels extra: pip install 'andrea[kernels]'")
    return found


@dataclass(frozen=True)
class Compiled:
    op: str
    arch: str
    cubin: bytes
    log: str


def compile_source(source: str, name: str, options: tuple[str, ...]) -> tuple[bytes, str]:
    """NVRTC-compile a kernel source (common.cuh spliced in) with these options (-arch=... among them) to a
    cubin: (cubin, compiler log); raises AndreaError with the compiler log."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source, name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [*options, f"-I{cuda_include_dir()}"])
        except nvrtc.NVRTCError as err:
            raise AndreaError(f"{name} does not compile ({' '.join(options)}): {err}\n{nvrtc.getProgramLog(prog)}") from None
        return nvrtc.getCUBIN(prog), nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


def compile_kernel(op: str, arch: str = "sm_90", folder: Path | None = None, precision: str = "fp32") -> Compiled:
    """NVRTC-compile kernels/<op>.cu to a cubin for `arch`; raises AndreaError with the compiler log."""
    cubin, log = compile_source(kernel_source(op, folder), f"kernels/{op}.cu", (f"-arch={arch}", *build_options(precision)))
    return Compiled(op, arch, cubin, log)


def compile_kernels(arch: str = "sm_90", folder: Path | None = None, precision: str = "fp32") -> dict[str, Compiled]:
    return {op: compile_kernel(op, arch, folder, precision) for op in KERNEL_FILES}


def hopper_build_wanted(compute_capability: str) -> bool:
    """Whether a device of this compute capability ("90") loads the HOPPER_ARCH builds."""
    return compute_capability == "90" and os.environ.get("ANDREA_WGMMA", "1") != "0"


def cubin_cache_dir() -> Path:
    """Where compiled cubins are kept: CuPy's kernel cache folder (CUPY_CACHE_DIR, else ~/.cupy/kernel_cache)."""
    return Path(os.environ.get("CUPY_CACHE_DIR") or Path.home() / ".cupy" / "kernel_cache")


def cached_cubin(op: str, arch: str, precision: str, cache_dir: Path | None = None, folder: Path | None = None) -> Path:
    """kernels/<op>.cu compiled for `arch` as a cubin file in cache_dir (default cubin_cache_dir()), named by
    a hash of the source and options; compiled on first use. (CuPy's own cache picks the target itself, so
    it cannot hold these.) Where cache_dir cannot be written, the cubin goes to a temporary file of its own."""
    options = (f"-arch={arch}", *build_options(precision))
    key = hashlib.sha256("\0".join((kernel_source(op, folder), *options)).encode()).hexdigest()[:24]
    path = Path(cache_dir or cubin_cache_dir()) / f"andrea-{op}-{arch}-{precision}-{key}.cubin"
    if not path.is_file():
        cubin = compile_kernel(op, arch, folder, precision).cubin
        try:
            with atomic_write(path) as f:
                f.write(cubin)
        except OSError:  # a cache folder that cannot be written: this process's own file instead
            fd, name = tempfile.mkstemp(prefix=path.stem + "-", suffix=".cubin")
            with os.fdopen(fd, "wb") as f:
                f.write(cubin)
            return Path(name)
    return path
