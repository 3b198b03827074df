"""Training: the loop, its supervisor, data parallel across GPUs, the stop signals."""
