"""The forward/backward schedule (written once, for either engine) and its per-op timing."""
