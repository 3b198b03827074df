"""SIGTERM / SIGUSR1 for `andrea train`, recorded from the first moment of the process.

The command line (andrea.cli.main, where the `andrea` console script enters) installs the handlers
before anything else is imported (argparse, NumPy, the engine, the data), so a signal that arrives
while the trainer starts is recorded instead of killing the process with the default action; the loop
acts on it at its first step boundary, or exits cleanly if there is nothing to train yet. Handlers
only set flags, so a signal cannot interrupt a checkpoint write.

A process that starts trainers (the supervisor, the --gpus launcher) starts them inside blocked(): the
signal mask is inherited across fork and exec, so a signal sent to a trainer before its handlers exist
stays pending, and install() lets it through once they do. What no process can cover for itself is
its own interpreter's start-up, before the console script's first line runs (docs/RELIABILITY.md).
Standard library only: it runs before everything else.
"""

from __future__ import annotations

import signal

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    def __init__(self):
        self.terminate = False
        self.snapshot = False
        self._old: dict = {}
        self._until_exit = False

    @property
    def installed(self) -> bool:
        return bool(self._old)

    def install(self, until_exit: bool = False) -> "StopSignals":
        """Record both signals from now on, then unblock them: one that arrived while the process that
        started this one held them blocked is delivered here, to the new handler. `until_exit` (the
        command line's install): restore() keeps the handlers, so a signal after the run ended, while the
        process exits, is recorded too instead of taking the default action."""
        if not self._old:
            for sig, handler in ((signal.SIGTERM, self._term), (signal.SIGUSR1, self._usr1)):
                self._old[sig] = signal.signal(sig, handler)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
        self._until_exit = self._until_exit or until_exit
        return self

    def restore(self) -> None:
        """Back to the handlers before install() (unless installed until exit), flags cleared (a later run
        in this process starts fresh)."""
        if not self._until_exit:
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


class blocked:
    """Both signals held pending in this thread for the block. A process started inside it inherits them
    blocked until its own install(); this process receives any that arrived once the block ends. (A class,
    not contextlib: this module stays at one import.)"""

    def __enter__(self):
        self._previous = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        return self

    def __exit__(self, *exc):
        signal.pthread_sigmask(signal.SIG_SETMASK, self._previous)

