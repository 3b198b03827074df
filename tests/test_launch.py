"""Programmatic dependent launches (andrea/engines/launch.py): the arguments go to the driver as the kernels declare
them, and on the GPU a step recorded with them computes the plain launches' bits (every kernel waits first)."""

import ctypes

import numpy as np
import pytest

pytest.importorskip("cupy")

from andrea.config import ModelShape  # noqa: E402
from andrea.engines import launch  # noqa: E402
from andrea.engines.crosscheck import synthetic_micro_batches  # noqa: E402
from andrea.model import Model, init_params  # noqa: E402

SHAPE = ModelShape(n_layer=2, d_model=128, n_head=2, vocab_size=301, seq_len=64)
OPTIMIZER = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "grad_clip": 1.0}


@pytest.mark.parametrize("value, c_type", [(np.int32(-7), ctypes.c_int32), (np.int64(2**40 + 3), ctypes.c_int64),
                                           (np.uint64(2**63 + 5), ctypes.c_uint64), (np.uint32(2**31 + 1), ctypes.c_uint32),
                                           (np.float32(0.1), ctypes.c_float), (np.float64(0.1), ctypes.c_double)])
def test_a_numpy_scalar_goes_as_its_own_c_type_and_bits(value, c_type):
    arg = launch._c_arg(value)
    assert type(arg) is c_type
    assert bytes(arg) == value.tobytes()


@pytest.mark.parametrize("value", [3, 0.5, True, np.int16(2), np.zeros(2, np.float32)])
def test_an_argument_of_no_declared_c_type_is_refused(value):
    with pytest.raises(TypeError, match="kernel argument"):
        launch._c_arg(value)


def test_grid_and_block_take_an_int_or_a_tuple():
    assert launch._dims(5) == (5, 1, 1)
    assert launch._dims(np.int64(5)) == (5, 1, 1)
    assert launch._dims((4, 3)) == (4, 3, 1)


def test_only_hopper_and_newer_record_them_and_the_switch_turns_them_off(monkeypatch):
    monkeypatch.setenv("ANDREA_PDL", "1")
    assert launch.pdl_wanted("90") and launch.pdl_wanted("100")
    assert not launch.pdl_wanted("89") and not launch.pdl_wanted("80")
    monkeypatch.setenv("ANDREA_PDL", "0")
    assert not launch.pdl_wanted("90")


def trained_state(precision: str, monkeypatch, pdl: str) -> tuple[bytes, list, int]:
    from andrea.engines.cuda_engine import CudaEngine

    monkeypatch.setenv("ANDREA_PDL", pdl)
    calls = []
    real = launch.launch_dependent
    monkeypatch.setattr(launch, "launch_dependent", lambda *a, **k: (calls.append(1), real(*a, **k)))
    model = Model(CudaEngine(precision=precision), SHAPE, micro_batch=4)
    model.load_state(init_params(model.layout, 5))
    out = [model.train_step(synthetic_micro_batches(SHAPE, 4, 2, step), step=step, lr=1e-3, optimizer=OPTIMIZER)
           for step in range(4)]
    return b"".join(a.tobytes() for a in model.host_state()), out, len(calls)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_a_step_recorded_with_dependent_launches_has_the_plain_launches_bits(precision, monkeypatch):
    import cupy

    if int(cupy.cuda.Device().compute_capability) < 90:
        pytest.skip("no programmatic dependent launch below compute capability 9.0")
    dependent, losses, n_dependent = trained_state(precision, monkeypatch, "1")
    plain, plain_losses, n_plain = trained_state(precision, monkeypatch, "0")
    assert n_dependent > 0 and n_plain == 0  # the recorded step took them, the switch turned them off
    assert losses == plain_losses
    assert dependent == plain


def test_the_launch_attribute_is_laid_out_as_cuda_h_and_set_in_place():
    assert ctypes.sizeof(launch._LaunchAttribute) == 72 and launch._LaunchAttribute.value.offset == 8
    attr = launch._LaunchAttribute(id=launch.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value.programmatic_stream_serialization_allowed = 1
    raw = bytes(attr)
    assert raw[:4] == (6).to_bytes(4, "little") and raw[8:12] == (1).to_bytes(4, "little") and not any(raw[12:])
    config = launch._LaunchConfig()
    assert ctypes.sizeof(config) == 56 and launch._LaunchConfig.stream.offset == 32
