"""Validation loss: the one implementation, used by the training loop and by `andrea eval`."""

from __future__ import annotations

import numpy as np


def validation_loss(model, windows, n_batches: int) -> float:
    """Mean loss over the first n_batches micro-batches of the validation windows (in order)."""
    losses = [model.forward(*windows.val_batch(i, model.micro_batch)) for i in range(n_batches)]
    return float(np.mean(losses))
