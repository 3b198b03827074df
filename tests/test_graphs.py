"""A recorded graph's small memset nodes as kernel nodes (andrea/engines/graphs.py; needs a CUDA device): the
bytes each memset writes, in its place among the graph's other nodes, and a training step's bits unchanged."""

from __future__ import annotations

import ctypes
import hashlib

import numpy as np
import pytest

from andrea.spec.config import load_experiment
from andrea.run.train import model_options
from conftest import EXPERIMENTS

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def engine():
    from andrea.engines.cuda_engine import CudaEngine

    return CudaEngine(precision="bf16")


def test_memset_nodes_of_each_element_size_write_their_bytes_in_their_place(engine):
    """Memsets of 1-, 2- (pitched rows) and 4-byte elements, each read by a kernel recorded after it, and one past
    SMALL_MEMSET_BYTES: the small ones become kernel nodes, the large one stays a memset, and a replay over
    poisoned buffers writes exactly the recorded bytes (a pitched row's gap untouched), each before its reader."""
    import cupy

    from andrea.engines.graphs import SMALL_MEMSET_BYTES, RecordedGraph, memset_bytes, node_kinds

    driver = ctypes.CDLL("libcuda.so.1")
    bytes1, words, pitched = (cupy.zeros(n, dtype=np.uint8) for n in (300, 400, 64 * 5))
    large = cupy.zeros(SMALL_MEMSET_BYTES + 4096, dtype=np.uint8)
    read = [cupy.zeros(n, dtype=np.int32) for n in (300, 100, 5 * 64, 8)]

    def record():
        stream = cupy.cuda.get_current_stream().ptr
        cupy.cuda.runtime.memsetAsync(bytes1.data.ptr, 0x5A, bytes1.nbytes, stream)
        assert driver.cuMemsetD32Async(ctypes.c_uint64(words.data.ptr), ctypes.c_uint(0xDEADBEEF), ctypes.c_size_t(100),
                                       ctypes.c_void_p(stream)) == 0
        assert driver.cuMemsetD2D16Async(ctypes.c_uint64(pitched.data.ptr), ctypes.c_size_t(64), ctypes.c_ushort(0xBEEF),
                                         ctypes.c_size_t(10), ctypes.c_size_t(5), ctypes.c_void_p(stream)) == 0
        cupy.cuda.runtime.memsetAsync(large.data.ptr, 0, large.nbytes, stream)
        # readers: each needs its memset's bytes (the rewrite keeps the edges)
        cupy.add(bytes1, 0, out=read[0])
        cupy.add(words.view(np.int32), 1, out=read[1])
        cupy.add(pitched, 0, out=read[2])
        cupy.add(large[-8:], 1, out=read[3])

    recorded = engine.capture(record)
    assert isinstance(recorded, RecordedGraph)
    assert memset_bytes(recorded) == [large.nbytes]
    assert node_kinds(recorded)["kernel"] >= 7
    for a in (bytes1, words, pitched, large):
        a.fill(0x11)
    for r in read:
        r.fill(-1)
    engine.replay(recorded)
    engine.synchronize()
    assert (bytes1.get() == 0x5A).all() and (read[0].get() == 0x5A).all()
    want_words = np.full(100, 0xDEADBEEF, dtype=np.uint32)
    assert (words.get().view(np.uint32) == want_words).all()
    assert (read[1].get() == want_words.view(np.int32) + 1).all()
    rows = pitched.get().reshape(5, 64)
    assert (rows[:, :20].copy().view(np.uint16) == 0xBEEF).all() and (rows[:, 20:] == 0x11).all()
    assert (read[2].get() == pitched.get()).all()
    assert (read[3].get() == 1).all() and not large.get().any()


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_a_step_s_graph_without_small_memsets_gives_the_recorded_graph_s_bits(precision, monkeypatch):
    """Steps of the 12M experiment (its products record cuBLASLt's memsets), with the step's graphs as recorded
    (ANDREA_GRAPH_MEMSETS=1) and rewritten: the same weights and moments after them, and no small memset left."""
    from andrea.schedule.crosscheck import OPTIMIZER, lr_at, synthetic_micro_batches
    from andrea.engines.cuda_engine import CudaEngine
    from andrea.engines.graphs import SMALL_MEMSET_BYTES, memset_bytes
    from andrea.schedule.model import Model, init_params

    experiment = load_experiment(EXPERIMENTS / "ANDREA-12M-TRAIN.json")
    shape = experiment.model

    def run(keep: bool):
        monkeypatch.setenv("ANDREA_GRAPH_MEMSETS", "1" if keep else "0")
        model = Model(CudaEngine(precision=precision), shape, 8, **model_options(experiment, "cuda"))
        model.load_state(init_params(model.layout, 7))
        for step in range(3):
            model.train_step(synthetic_micro_batches(shape, 8, 2, step, 7), step=step, lr=lr_at(step),
                             optimizer=OPTIMIZER)
        small = [n for g in model.step_graphs for n in memset_bytes(g) if n <= SMALL_MEMSET_BYTES]
        params, m, v = model.host_state()
        return hashlib.sha256(params.tobytes() + m.tobytes() + v.tobytes()).hexdigest(), small

    (recorded, small_recorded), (rewritten, small_left) = run(keep=True), run(keep=False)
    assert small_recorded, "the recorded step has no small memset: this test checks nothing"
    assert small_left == []
    assert rewritten == recorded
