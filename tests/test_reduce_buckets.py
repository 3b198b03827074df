"""The data-parallel gradient sums, on the CPU with a recording stand-in for NCCL: the buckets the backward
hands over cover the flat gradient exactly once, only on a step's last micro-batch, and each only after
the backward has finished writing it."""

import numpy as np

from andrea.spec.config import ModelShape
from andrea.schedule.crosscheck import OPTIMIZER, synthetic_micro_batches
from andrea.engines.numpy_engine import NumpyEngine
from andrea.schedule.model import Model, init_params

SHAPE = ModelShape(n_layer=3, d_model=16, n_head=2, vocab_size=41, seq_len=8)


class Recorder:
    """DataParallel's interface for one rank: records each bucket and a copy of it when handed over, and the
    whole gradient when the step asks for the loss's sum (after the micro-batches, before any scaling)."""

    world = 1

    def __init__(self):
        self.buckets, self.waits, self.grads, self.final = [], 0, None, None

    def reduce_async(self, grads):
        self.buckets.append((grads, grads.copy()))

    def wait(self):
        self.waits += 1

    def reduce_loss(self, loss):
        self.final = self.grads.copy()
        return loss


def test_buckets_cover_the_gradient_once_and_are_final_when_handed_over():
    dp = Recorder()
    model = Model(NumpyEngine(), SHAPE, micro_batch=2, data_parallel=dp)
    model.load_state(init_params(model.layout, 3))
    grads = dp.grads = model.buf["grads"]
    model.train_step(synthetic_micro_batches(SHAPE, 2, 3, step=0), step=0, lr=1e-3, optimizer=OPTIMIZER)
    assert dp.waits == 1  # one reducing backward: the last micro-batch's
    covered = np.zeros(grads.size, dtype=int)
    for view, at_handover in dp.buckets:
        start = (view.__array_interface__["data"][0] - grads.__array_interface__["data"][0]) // grads.itemsize
        covered[start:start + view.size] += 1
        np.testing.assert_array_equal(at_handover, dp.final[start:start + view.size])
    assert (covered == 1).all()
