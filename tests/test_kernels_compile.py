"""Every kernel file compiles with NVRTC for each target architecture and each precision's build (no GPU
needed), and every kernel the CUDA engine launches is in the compiled code under its seed name."""

import pytest

from andrea.kernels_build import ARCHS, KERNEL_FILES, compile_kernel, kernel_dir, kernel_source
from andrea.ops import kernel_files


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("op", KERNEL_FILES)
def test_kernel_compiles(op, arch, precision):
    compiled = compile_kernel(op, arch, precision=precision)
    for name in kernel_files()[op]:
        assert name.encode() in compiled.cubin, f"{name} missing from kernels/{op}.cu ({arch})"


def test_every_kernel_file_is_built():
    on_disk = {p.stem for p in kernel_dir().glob("*.cu")}
    assert on_disk == set(KERNEL_FILES)


def test_every_kernel_file_holds_kernels_the_engine_loads():
    """An op pair made only of cuBLAS products has no kernel file (andrea/kernels_build.py), so none is empty."""
    loaded = kernel_files()
    assert set(loaded) == set(KERNEL_FILES)
    assert all(loaded.values())


def test_header_is_spliced_into_the_source():
    """The engine's module cache is keyed by source text, so the header must be part of it."""
    source = kernel_source("layernorm")
    assert '#include "common.cuh"' not in source
    assert "block_sum" in source
