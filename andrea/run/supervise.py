"""`andrea train --supervise`: the training proxy. Runs the trainer as a child process, forwards
SIGTERM/SIGUSR1 to it (held pending while it starts), and restarts it from its last checkpoint when it
dies without finishing (a crash, SIGKILL, the kernel's out-of-memory killer), up to --max-restarts times."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from andrea.store.runfiles import EXIT_NONFINITE, RESTARTS_ENV, RunFiles, append_record
from andrea.run.stop_signals import SIGNALS, STOP_SIGNALS, blocked

# Exit statuses that a restart cannot fix: a usage/input error, or a numerical fault that would recur.
FINAL_STATUSES = {2, EXIT_NONFINITE}
# How each attempt starts (attempt_command), so the trainer's command handed to supervise() leaves them out.
START_OPTIONS = ("resume", "init_from")


def attempt_command(command: list[str], args, files: RunFiles, attempt: int) -> list[str]:
    """The trainer's command for one attempt: the first starts as asked; a restart continues from the
    last checkpoint, or starts over (from --init-from, if given) when none was written yet."""
    if attempt == 0:
        return command + (["--resume"] if args.resume else ["--init-from", args.init_from] if args.init_from else [])
    return command + (["--resume"] if files.ckpt.exists() or not args.init_from else ["--init-from", args.init_from])


def describe(status: int) -> str:
    if status < 0:
        return f"killed by {signal.Signals(-status).name}"
    return f"exited with status {status}"


def supervise(args, command: list[str]) -> int:
    """Run `command` (the trainer's, less START_OPTIONS) until it finishes or fails for good."""
    files = RunFiles(Path(args.out))
    forwarded: list[int] = []
    waiting: list[int] = []  # arrived while no trainer ran: handed to the next one as it starts
    child: subprocess.Popen | None = None

    def forward(signum, frame):
        forwarded.append(signum)
        if child is not None and child.poll() is None:
            child.send_signal(signum)
        else:
            waiting.append(signum)

    old = {s: signal.signal(s, forward) for s in SIGNALS}
    # arrived while this process started, before forward() was in place
    early = [signum for signum, seen in ((signal.SIGTERM, STOP_SIGNALS.terminate),
                                         (signal.SIGUSR1, STOP_SIGNALS.snapshot)) if seen]
    forwarded += early
    waiting += early
    try:
        restarts = 0
        while True:
            # The trainer starts with both signals blocked (it unblocks them once its handlers are in place),
            # so one forwarded while it starts waits for it instead of killing it and costing a restart.
            with blocked():
                if signal.SIGTERM in forwarded:
                    print("andrea train: SIGTERM before the trainer started; nothing trained", file=sys.stderr)
                    return args.sigterm_exit_code
                child = subprocess.Popen(attempt_command(command, args, files, restarts),
                                         env={**os.environ, RESTARTS_ENV: str(restarts)})
                while waiting:
                    child.send_signal(waiting.pop(0))
            status = child.wait()
            if status == 0 or status in FINAL_STATUSES or signal.SIGTERM in forwarded:
                return status if status >= 0 else 128 - status
            if restarts >= args.max_restarts:
                print(f"andrea train: the trainer {describe(status)}; gave up after {restarts} restarts",
                      file=sys.stderr)
                return 1
            restarts += 1
            files.loss.parent.mkdir(parents=True, exist_ok=True)  # a trainer that died at once made no folder
            append_record(files.loss, {"event": "restart", "wall": time.time(), "attempt": restarts,
                                      "cause": describe(status)})
            print(f"andrea train: the trainer {describe(status)}; restart {restarts} of {args.max_restarts} "
                  "from the last checkpoint", file=sys.stderr)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
