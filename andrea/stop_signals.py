"""SIGTERM / SIGUSR1 for `andrea train`, recorded from the first moment of the process.

The command line installs the handlers before it imports anything heavy (NumPy, the engine, the
data), so a signal that arrives while the trainer starts is recorded instead of killing the process
with the default action; the loop acts on it at its first step boundary, or exits cleanly if there
is nothing to train yet. Handlers only set flags, so a signal cannot interrupt a checkpoint write.
Standard library only: it runs before everything else.
"""

from __future__ import annotations

import signal


class StopSignals:
    def __init__(self):
        self.terminate = False
        self.snapshot = False
        self._old: dict = {}

    @property
    def installed(self) -> bool:
        return bool(self._old)

    def install(self) -> "StopSignals":
        if not self._old:
            for sig, handler in ((signal.SIGTERM, self._term), (signal.SIGUSR1, self._usr1)):
                self._old[sig] = signal.signal(sig, handler)
        return self

    def restore(self) -> None:
        """Back to the handlers before install(), flags cleared (a later run in this process starts fresh)."""
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}
        self.terminate = self.snapshot = False

    def _term(self, signum, frame):
        self.terminate = True

    def _usr1(self, signum, frame):
        self.snapshot = True


# The process's one recorder: the command line installs it, the trainer and its supervisor read it.
STOP_SIGNALS = StopSignals()
