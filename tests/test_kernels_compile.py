"""Every kernel file compiles with NVRTC for each target architecture and each precision's build (no GPU
needed), and every kernel the CUDA engine launches is in the compiled code under its seed name; the files
with a Hopper build compile for sm_90a too, with Hopper's own kernels in it."""

import os
import struct
from concurrent.futures import ThreadPoolExecutor

import pytest

from andrea.ops.kernels_build import (ARCHS, HOPPER_ARCH, KERNEL_FILES, cached_cubin, compile_kernel, compile_source,
                                      hopper_build_wanted, kernel_dir, kernel_source)
from andrea.ops import hopper_kernel_files, kernel_files

PRECISIONS = ("fp32", "bf16", "fp16")
BUILDS = [(op, arch, p) for op in KERNEL_FILES for arch in ARCHS for p in PRECISIONS] + \
         [(op, HOPPER_ARCH, p) for op in sorted(hopper_kernel_files()) for p in ("bf16", "fp16")]


@pytest.fixture(scope="module")
def compiled():
    """Every build of the tests below, compiled side by side (NVRTC releases the GIL: one build a core); a
    build's error is kept and raised by its own test."""
    def build(key):
        try:
            return compile_kernel(key[0], key[1], precision=key[2])
        except Exception as err:  # noqa: BLE001 - re-raised in the test of that build
            return err

    # the first alone: NVRTC loads its builtins library on first use, and first uses side by side can fail to
    first = build(BUILDS[0])
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return {BUILDS[0]: first, **dict(zip(BUILDS[1:], pool.map(build, BUILDS[1:])))}


def build_of(compiled, op, arch, precision):
    result = compiled[(op, arch, precision)]
    if isinstance(result, Exception):
        raise result
    return result


@pytest.mark.slow  # with the Hopper builds below: the `compiled` fixture, every build (~50-90 s on 2 cores)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("op", KERNEL_FILES)
def test_kernel_compiles(compiled, op, arch, precision):
    built = build_of(compiled, op, arch, precision)
    for name in kernel_files()[op]:
        assert name.encode() in built.cubin, f"{name} missing from kernels/{op}.cu ({arch})"


# A block's shared memory on the consumer GPUs the builds without Hopper's target serve (sm_86: RTX 30xx; sm_89:
# RTX 40xx): 48 KB static, 99 KB with the dynamic part (opted into per kernel).
STATIC_SHARED_LIMIT = 48 * 1024
BLOCK_SHARED_LIMIT = 99 * 1024


def shared_bytes(cubin: bytes) -> dict[str, int]:
    """Static shared memory of each kernel of a cubin: the size of its ELF section `.nv.shared.<kernel>`."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = sections[shstrndx][4]

    def name(offset: int) -> str:
        return cubin[names + offset:cubin.index(b"\0", names + offset)].decode()

    return {name(s[0]).removeprefix(".nv.shared."): s[5] for s in sections if name(s[0]).startswith(".nv.shared.")}


def test_shared_bytes_reads_a_kernels_static_shared_memory():
    built = compile_source('extern "C" __global__ void k_big(float *x) { __shared__ float t[3000]; '
                           't[threadIdx.x] = x[0]; __syncthreads(); x[1] = t[5]; }\n'
                           'extern "C" __global__ void k_none(float *x) { x[0] = 1.0f; }', "t.cu", ("-arch=sm_89",))[0]
    assert shared_bytes(built)["k_big"] == 3000 * 4 and shared_bytes(built).get("k_none", 0) == 0


@pytest.mark.slow  # the `compiled` fixture
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("arch", ("sm_80", "sm_89"))
def test_every_kernel_fits_a_consumer_gpus_shared_memory(compiled, arch, precision):
    """The path without Hopper's own build (ANDREA_WGMMA=0, or any other GPU) asks no block for more shared
    memory than an RTX 3060 or 4090 has: the static part of each kernel, plus the dynamic part the engine
    sets for the attention kernels (attn.shared_memory)."""
    from andrea.ops import attn

    dynamic = attn.shared_memory()
    for op in KERNEL_FILES:
        for kernel, static in shared_bytes(build_of(compiled, op, arch, precision).cubin).items():
            assert static <= STATIC_SHARED_LIMIT, f"{kernel} ({op}.cu, {arch}, {precision}): {static} static bytes"
            total = static + dynamic.get(kernel, 0)
            assert total <= BLOCK_SHARED_LIMIT, f"{kernel} ({op}.cu, {arch}, {precision}): {total} bytes a block"


def test_every_kernel_file_is_built():
    on_disk = {p.stem for p in kernel_dir().glob("*.cu")}
    assert on_disk == set(KERNEL_FILES)


def test_every_kernel_file_holds_kernels_the_engine_loads():
    """An op pair made only of cuBLAS products has no kernel file (andrea/ops/kernels_build.py), so none is empty."""
    loaded = kernel_files()
    assert set(loaded) == set(KERNEL_FILES)
    assert all(loaded.values())


def test_header_is_spliced_into_the_source():
    """The engine's module cache is keyed by source text, so the header must be part of it."""
    source = kernel_source("layernorm")
    assert '#include "common.cuh"' not in source
    assert "block_sum" in source


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("op", sorted(hopper_kernel_files()))
def test_hopper_build_compiles(compiled, op, precision):
    """The sm_90a build holds the file's kernels and Hopper's own beside them."""
    built = build_of(compiled, op, HOPPER_ARCH, precision)
    for name in (*kernel_files()[op], *hopper_kernel_files()[op]):
        assert name.encode() in built.cubin, f"{name} missing from the {HOPPER_ARCH} build of kernels/{op}.cu"


@pytest.mark.slow
@pytest.mark.parametrize("op", sorted(hopper_kernel_files()))
def test_hopper_kernels_are_only_in_the_hopper_build(compiled, op):
    """The warpgroup products need sm_90a: a plain sm_90 build (what runs on other GPUs' code paths) has none."""
    built = build_of(compiled, op, "sm_90", "bf16")
    for name in hopper_kernel_files()[op]:
        assert name.encode() not in built.cubin


def test_hopper_build_is_wanted_on_compute_capability_90_only(monkeypatch):
    monkeypatch.delenv("ANDREA_WGMMA", raising=False)
    assert hopper_build_wanted("90")
    assert not hopper_build_wanted("89") and not hopper_build_wanted("100")
    monkeypatch.setenv("ANDREA_WGMMA", "0")
    assert not hopper_build_wanted("90")


@pytest.mark.slow  # three NVRTC builds; the test below keeps one build in the inner loop
def test_cached_cubin_compiles_once_per_source(tmp_path, monkeypatch):
    import shutil

    from andrea.ops import kernels_build

    first = cached_cubin("attn_bf16", HOPPER_ARCH, "bf16", tmp_path)
    assert first.is_file() and first.parent == tmp_path and first.read_bytes().startswith(b"\x7fELF")

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(kernels_build, "compile_kernel", no_compile)
    assert cached_cubin("attn_bf16", HOPPER_ARCH, "bf16", tmp_path) == first
    monkeypatch.undo()
    # an edited source (here: a copy of the folder with one more comment line) is a new file
    folder = tmp_path / "kernels"
    shutil.copytree(kernel_dir(), folder)
    (folder / "attn_bf16.cu").write_text((folder / "attn_bf16.cu").read_text() + "// edited\n")
    edited = cached_cubin("attn_bf16", HOPPER_ARCH, "bf16", tmp_path, folder)
    assert edited != first and edited.is_file()
    assert cached_cubin("attn_bf16", HOPPER_ARCH, "fp16", tmp_path) not in (first, edited)


def test_cached_cubin_works_without_a_writable_cache(tmp_path):
    """A cache folder that cannot be created (here: below a file) still gives a loadable cubin, outside it."""
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    path = cached_cubin("attn_bf16", HOPPER_ARCH, "bf16", blocked / "cache")
    try:
        assert path.is_file() and path.read_bytes().startswith(b"\x7fELF")
        assert blocked not in path.parents
    finally:
        path.unlink()


@pytest.mark.parametrize("act_vec", [4, 8])  # fp32, 16-bit activations
def test_softmax_block_leaves_each_thread_a_few_groups_of_the_row(act_vec):
    from andrea.ops.base import kernel_defines
    from andrea.ops.loss import LOSS_GROUPS_PER_THREAD, softmax_threads

    most = kernel_defines("loss")["LOSS_THREADS"]
    for V in (1, 64, 301, 4096, 50304, 10**6):
        threads = softmax_threads(V, act_vec)
        assert 32 <= threads <= most and threads & (threads - 1) == 0, (V, threads)
        # as large as it can be while every thread keeps LOSS_GROUPS_PER_THREAD groups of the row
        assert threads == 32 or threads * act_vec * LOSS_GROUPS_PER_THREAD <= V, (V, threads)
        assert threads == most or 2 * threads * act_vec * LOSS_GROUPS_PER_THREAD > V, (V, threads)
