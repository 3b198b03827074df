"""The training loop: `andrea train`.

Outputs for results/NAME.ckpt (see docs/ANDREA.md):
    NAME.ckpt          the seed's checkpoint format, atomic
    NAME.state.json    what the format cannot hold: experiment, step, data, sha256 of the ckpt
    NAME.loss.json     JSON Lines, one record per step (+ event lines); appended, never truncated
    NAME.samples.json  generated text at the sample interval (when a tokenizer is present)
    NAME.log           the run's log lines

The state, the checkpoints it vouches for (the best one too), the phase archives and the order they are written
in are the run's book (andrea/run/run_book.py); what --resume and --init-from refuse is andrea/run/train_start.py.

SIGTERM: checkpoint at the next step boundary, exit (0 by default) once durable.
SIGUSR1: checkpoint, continue. See docs/RELIABILITY.md for every failure the loop survives.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from andrea.common.atomic import write_json_atomic
from andrea.spec.config import load_experiment
from andrea.common.errors import AndreaError, error_sentence
from andrea.store.identity import data_fingerprint, tokenizer_fingerprint
from andrea.store.loader import rank_rows
from andrea.spec.memory import device_bytes
from andrea.store.mixing import Mixture, MixState
from andrea.common.options import at_least
from andrea.run.parallel import launch, rank_from_env
from andrea.run.run_book import RunBook, UntrustedState, take_lock
from andrea.store.runfiles import EXIT_NONFINITE, RunFiles, end_torn_line
from andrea.run.stop_signals import STOP_SIGNALS
from andrea.run.supervise import START_OPTIONS, supervise
from andrea.run.train_start import Start, StartChecks, refuse_existing_checkpoint

N_SAMPLE_PROMPTS = 3
# Options of the supervisor itself, never handed to the trainer processes it starts.
SUPERVISOR_ONLY = ("supervise", "max_restarts")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a model from token shards",
        description="Train an experiment on token shards (DATA/train.bin, DATA/val.bin). Writes the "
        "checkpoint and, beside it, .state.json, .loss.json (one JSON line per step), .samples.json and "
        ".log. SIGTERM checkpoints and exits; SIGUSR1 checkpoints and continues.",
    )
    add_options(p)
    p.set_defaults(func=main)


def add_options(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """Every option of `andrea train`, added to `p` and returned in order (add_argument returns each one's
    Action); child_command() re-emits them for the processes it starts."""
    start = p.add_mutually_exclusive_group()
    return [
        p.add_argument("--experiment", required=True, help="experiment JSON (config/experiments/ANDREA-*-TRAIN.json)"),
        p.add_argument("--data", required=True, help="folder with train.bin, val.bin and optionally tokenizer.json"),
        p.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                       help="override one field of the experiment (repeatable): KEY a dotted path, phases by name "
                       "(phases.main.length.steps=2000), other lists by index (optimizer.betas.1=0.99); VALUE JSON when "
                       "it parses, else a string. The run uses, hashes and records the experiment so changed"),
        p.add_argument("--out", required=True, help="checkpoint to write, e.g. results/ANDREA-12M.ckpt"),
        p.add_argument("--engine", default="auto", choices=("auto", "numpy", "cuda"),
                       help="auto (default) uses CUDA when a device is present, else NumPy"),
        p.add_argument("--max-steps", type=at_least(1), default=None,
                       help="stop after this many optimizer steps in total (the LR schedule still spans the full run)"),
        p.add_argument("--cpu-max-steps", type=at_least(1), default=None, metavar="N",
                       help="when the run trains on the NumPy engine (no GPU), stop after N steps in total: the first N "
                       "of the same program, which --resume on a GPU continues (the log, the state and `andrea inspect` "
                       "say the run is unfinished)"),
        start.add_argument("--resume", action="store_true",
                           help="continue from --out if it exists and its .state.json matches the experiment "
                           "(starts from step 0 if there is no checkpoint yet)"),
        start.add_argument("--init-from", metavar="CKPT", help="start from any checkpoint of this model size (weights, m, v, step)"),
        p.add_argument("--switch-data", action="store_true",
                       help="with --resume: continue on --data although the run was trained on other data or another "
                       "tokenizer (without it that is refused); the switch is logged and kept in .state.json"),
        p.add_argument("--tokenizer", help="tokenizer.json for samples (default: DATA/tokenizer.json if present)"),
        p.add_argument("--on-nonfinite", choices=("stop", "skip"), default="stop",
                       help="a NaN/inf loss or gradient norm: stop before the update (default, exit 3) or skip the step"),
        p.add_argument("--sigterm-exit-code", type=int, default=0, metavar="N",
                       help="exit status after a SIGTERM checkpoint (default 0; a workflow that should retry a "
                       "preempted job uses a non-zero one, e.g. 75)"),
        p.add_argument("--supervise", action="store_true",
                       help="run training as a child process and restart it from the last checkpoint when it dies "
                       "(crash, SIGKILL, out of memory); SIGTERM/SIGUSR1 are forwarded"),
        p.add_argument("--max-restarts", type=int, default=3, help="with --supervise: restarts before giving up (default 3)"),
        p.add_argument("--gpus", type=int, default=None, metavar="N",
                       help="data-parallel training on N GPUs of this host through NCCL (one process per GPU; "
                       "under SLURM, srun starts one task per GPU instead); the experiment's batch_size is the global batch"),
    ]


def child_command(args: argparse.Namespace, omit: tuple[str, ...] = ()) -> list[str]:
    """The `andrea train` command of a trainer process the supervisor or the launcher starts: every
    option of add_options() whose parsed value is not its default, less the supervisor's own and
    those in `omit`, so that an option added there reaches the child with no change here."""
    cmd = [sys.executable, "-m", "andrea.cli", "train"]
    for action in add_options(argparse.ArgumentParser(add_help=False)):
        value = getattr(args, action.dest)
        if action.dest in SUPERVISOR_ONLY + omit or value == action.default:
            continue
        flag = action.option_strings[-1]
        if action.nargs == 0:
            cmd += [flag]
        else:  # an option given several times (action="append", e.g. --set) goes on once per value
            cmd += [a for v in (value if isinstance(value, list) else [value]) for a in (flag, str(v))]
    return cmd


class Log:
    """Log lines to stderr and to NAME.log."""

    def __init__(self, path: Path, console):
        self.path = path
        self.console = console

    def __call__(self, msg: str) -> None:
        self.console.print(msg, highlight=False, markup=False, soft_wrap=True)
        self.record(msg)

    def record(self, msg: str) -> None:
        """The line in NAME.log only."""
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        with open(self.path, "a") as f:
            f.write(f"{stamp} {msg}\n")


def model_options(exp, engine_name: str) -> dict:
    """The experiment's memory options for the training model on this engine. The NumPy engine recomputes
    nothing: recompute trades a device's memory for time, and on the host only the time would be paid (the
    bits are the same either way). The classifier's pieces stay: they are part of the trajectory."""
    options = exp.memory_options
    return {**options, "recompute": ()} if engine_name == "numpy" else options


class Trainer:
    """One invocation of `andrea train`: the data, engine and model it builds, and the loop. The run's files are
    its book's (self.book); what a start refuses is checked by self.checks."""

    def __init__(self, args, console):
        self.args, self.console = args, console
        self.exp = load_experiment(args.experiment, args.set or ())
        self.files = RunFiles(Path(args.out))
        self.files.ckpt.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank_from_env() if args.gpus else None
        self.is_main = self.rank is None or self.rank.is_main
        self.log = self._open_run()
        self._read_data(Path(args.data))
        self.book = RunBook(self.files, self.exp, list(args.set or []), self.program, self.data_record,
                            self.n_train_tokens, self.tokenizer_record, self.mixture,
                            MixState.fresh(len(self.train_windows.sources)), self.headline, self.log, self.is_main)
        command = ["andrea", "train"] + child_command(args, omit=("resume", "init_from", "switch_data", "out"))[4:]
        self.checks = StartChecks(args, self.exp, self.program, self.files, self.data_dir, self.data_record,
                                  self.tokenizer_record, self.n_train_tokens, command, self.book.event, self.log)
        # every refusal of --resume / --init-from comes before the engine and its memory plan are built and printed
        self.start_from = self.checks.check()
        self._build_engine()
        self._build_model()
        self.book.model = self.model  # the checkpoints hold its weights, m and v
        self.elapsed_before = 0.0
        self.spent = TimeSpent()

    def _open_run(self):
        """The run's lock and log (the main rank's; the other ranks log nothing); a checkpoint already there is
        refused unless --resume continues it."""
        if self.is_main:
            self._lock = take_lock(self.files)
            # refused before the engine and its memory plan are built and printed
            refuse_existing_checkpoint(self.files, self.args.resume)
        torn = self.is_main and end_torn_line(self.files.loss)
        log = Log(self.files.log, self.console) if self.is_main else (lambda msg: None)
        if torn:
            log(f"{self.files.loss}: its last line was cut short (a full disk or a kill); ended it there, "
                "readers skip it")
        return log

    def _read_data(self, data: Path) -> None:
        """The token shards, the program the experiment makes of them, the mixture of their sources, and what
        the run is made from (the data's and the tokenizer's fingerprints)."""
        from andrea.store.loader import TokenWindows

        shape = self.exp.model
        self.data_dir = data
        self.train_windows = TokenWindows(data / "train.bin", shape.seq_len, self.exp.seed, shape.vocab_size)
        self.val_windows = TokenWindows(data / "val.bin", shape.seq_len, self.exp.seed, shape.vocab_size)
        self.n_train_tokens = int(self.train_windows.tokens.size)
        self.program = self.exp.program(self.n_train_tokens)
        self.total_steps = self.program.total_steps
        self.masks = self.train_windows.has_masks and self.val_windows.has_masks
        for phase in self.program.phases:
            if phase.loss_on == "assistant" and not self.masks:
                raise AndreaError(f"{self.exp.path}: phase {phase.name!r} counts only assistant tokens (loss_on), but "
                                  f"{data} has no loss masks beside its shards; rerun `andrea tokenize`")
        # the validation loss a best checkpoint is chosen by: the assistant tokens' where masks say which they are
        self.headline = "val_loss_assistant" if self.masks else "val_loss"
        self.mixture = Mixture(self.train_windows, self.program, self.exp.seed, self.exp.batch_size, self.exp.path)
        if self.mixture.active:
            self._check_val_sources()
        self.data_record = {"dir": str(data), **data_fingerprint(data, self.train_windows.files + self.val_windows.files)}
        self.tokenizer_path = self._tokenizer_path(self.args.tokenizer)
        self.tokenizer_record = tokenizer_fingerprint(self.tokenizer_path)

    def _build_engine(self) -> None:
        """The engine (CUDA on every rank of a data-parallel run) and the ranks' communicator."""
        from andrea.engines import make_engine

        args = self.args
        self.data_parallel = None
        world = 1
        if self.rank is not None:
            world = self.rank.world
            if self.exp.batch_size % (world * self.exp.micro_batches):
                raise AndreaError(f"{self.exp.path}: field 'batch.batch_size' ({self.exp.batch_size}) must be divisible "
                                  f"by GPUs x micro_batches ({world} x {self.exp.micro_batches})")
            if args.engine == "numpy":
                raise AndreaError("--gpus needs the CUDA engine; drop --engine numpy")
            import cupy

            cupy.cuda.Device(self.rank.local).use()
        t_engine = time.perf_counter()
        self.engine = make_engine("cuda" if self.rank is not None else args.engine, precision=self.exp.precision)
        t_engine = time.perf_counter() - t_engine
        if self.rank is not None:
            from andrea.run.parallel import DataParallel, forget_unique_id, unique_id

            self.data_parallel = DataParallel(self.rank, unique_id(self.rank, self.files))
            forget_unique_id(self.rank, self.files)  # every rank has joined: the id has served
            self.log(f"data parallel: {world} ranks, {self.exp.batch_size // world} sequences per rank per step")
        if self.engine.name == "numpy" and args.engine == "auto":  # auto found no device
            self.log("engine: numpy (no CUDA device found; the NumPy reference engine runs on the CPU)")
        else:
            self.log(f"engine: {self.engine.name}" + (
                f" ({self.exp.precision}; its kernels ready in {t_engine:.1f} s: compiled on a machine's first run, "
                "read from CuPy's cache after)" if self.engine.name == "cuda" else ""))
        self.world = world

    def _build_model(self) -> None:
        """The training model and the sampler, and their memory plan, printed."""
        from andrea.schedule.model import Model

        micro = self.exp.batch_size // (self.world * self.exp.micro_batches)
        self.model = Model(self.engine, self.exp.model, micro, data_parallel=self.data_parallel,
                           **model_options(self.exp, self.engine.name))
        self.sampler = None
        self.prompts: list[list[int]] = []
        self._setup_sampling()
        # every buffer on the device: the training model's, and the sampler's (inside it, or beside it)
        plans = [self.model.plan] + ([self.sampler.model.plan] if self.sampler else [])
        where = "inside the training model's memory" if self.sampler and self.sampler.shares_weights else "beside it"
        if self.is_main:
            self.console.print(self.model.plan.render(f"Memory plan: {self.exp.name}, micro-batch {micro}"))
            if self.sampler:
                self.console.print(self.sampler.model.plan.render(f"Memory plan: the sampler (micro-batch 1), {where}"))
        self.log(f"memory plan: {device_bytes(*plans):,} bytes in {sum(len(p.buffers) for p in plans)} buffers"
                 + (f" (training model and sampler, {where}; the engine's own buffers once)" if self.sampler else ""))

    def _check_val_sources(self) -> None:
        """A mixing run measures each source's validation loss: every source needs its val windows."""
        train, val = self.train_windows, self.val_windows
        if val.sources != train.sources:
            raise AndreaError(f"{self.data_dir}: the train split has the sources {', '.join(map(str, train.sources))} but the "
                              f"val split {', '.join(map(str, val.sources))}; rerun `andrea tokenize`")
        for k, shard in enumerate(val.shards if len(val.sources) > 1 else ()):
            if val.source_windows(k) == 0:
                raise AndreaError(f"{shard}: the source {val.sources[k]!r} has {val.source_tokens(k)} validation tokens, "
                                  f"fewer than one sequence of {val.seq_len + 1}, so its validation loss cannot be "
                                  "measured; give it more data (a larger val fraction) or drop it from data.sources")

    def _tokenizer_path(self, explicit) -> Path | None:
        from andrea.tools.inference import find_tokenizer

        path = find_tokenizer(self.data_dir, explicit)
        if path is not None and not path.is_file():
            raise AndreaError(f"{path}: tokenizer file not found")
        return path

    def _setup_sampling(self) -> None:
        from andrea.tools.inference import load_tokenizer
        from andrea.tools.sample import Sampler, validation_prompts

        if self.exp.intervals["sample"] <= 0 or not self.is_main:
            return
        path = self.tokenizer_path
        if path is None:
            self.log(f"samples: skipped (no tokenizer.json in {self.data_dir}; pass --tokenizer to enable)")
            return
        tokenizer = load_tokenizer(path)
        self.prompts = validation_prompts(tokenizer, self.val_windows.tokens, N_SAMPLE_PROMPTS)
        if not self.prompts:
            self.log("samples: skipped (no conversation with an assistant turn in val.bin)")
            return
        try:
            self.sampler = Sampler(self.engine, self.exp.model, tokenizer, share=self.model)
        except ValueError as err:  # the training model's transient buffers are too small for it
            self.log(f"samples: the sampler needs memory of its own ({err})")
            self.sampler = Sampler(self.engine, self.exp.model, tokenizer)

    # ---- start state -------------------------------------------------------------------------
    def start_step(self, stop: int) -> int:
        from andrea.schedule.model import init_params

        start, self.start_from = self.start_from, None
        if start is not None and start.how == "resume":
            return self._resume(start, stop)
        self.book.set_aside(self.args.resume)
        if start is not None:  # --init-from
            self.model.load_state(start.params, start.m, start.v)
            self.book.event("init_from", step=start.step, checkpoint=str(self.args.init_from), stop=stop,
                            total_steps=self.total_steps)
            return start.step
        self.model.load_state(init_params(self.model.layout, self.exp.seed))
        self.book.event("start", step=0, stop=stop, total_steps=self.total_steps)
        return 0

    def _resume(self, start: Start, stop: int) -> int:
        state, step = start.state, start.step
        self.model.load_state(start.params, start.m, start.v)
        if self.model.loss_scale is not None and "loss_scale" in state:
            self.model.loss_scale.load(state["loss_scale"])
        if self.model.histories:
            self.model.load_histories(state)
        entry = self.book.resume(state, step, start.data_history)
        self.elapsed_before = float(entry["elapsed_s"]) if entry else 0.0
        self.book.mix_state = self._resumed_mixing(entry, step)
        written_on = state.get("cpu", {}).get("blas")
        now = self.book.cpu()["blas"] if self.engine.name == "numpy" else None
        if now and written_on and written_on != now:
            self.log(f"resume: written with BLAS {written_on}, now {now}; the thread count does not "
                     "change a CPU run's bytes, but another BLAS library or kernel may (docs/REPRODUCIBILITY.md)")
        self.book.event("resume", step=step, stop=stop, total_steps=self.total_steps)
        self.log(f"resumed {self.files.ckpt} at step {step}")
        if start.data_switch:
            before, changes = start.data_switch
            self.book.event("data_switched", step=step, before=before, now=str(self.data_dir), changes=changes)
            self.log(f"resume: --switch-data: trained on {before} until step {step}, continues on {self.data_dir} "
                     f"({'; '.join(changes)})")
        if state.get("experiment") != self.exp.raw or state.get("overrides", []) != list(self.args.set or []):
            # changed where it may (after the steps run): the state says at once what the run now is (a phase
            # archived before the next checkpoint holds it too)
            self.book.write_state(step, self.elapsed_before)
        return step

    def _resumed_mixing(self, entry: dict, step: int) -> MixState:
        """The mixing state of the checkpoint resumed from; a run written before mixing existed drew every batch
        by the loader's scheme, so its rows per source are counted again from the steps it trained."""
        n = len(self.train_windows.sources)
        if "mixing" in entry:
            return MixState.from_json(entry["mixing"], n)
        if self.mixture.active and any(self.mixture.policies[p.name] for p in self.program.phases if p.start < step):
            raise self.checks.cannot_resume(f"its .state.json holds no mixing state for step {step}", None)
        state = MixState.fresh(n)
        skipped = set(self.book.skipped_steps)
        for s in range(step):
            if s + 1 not in skipped:
                for k in self.train_windows.train_sources(s, self.exp.batch_size):
                    state.rows[k] += 1
        return state

    # ---- outputs -----------------------------------------------------------------------------
    def write_samples(self, step: int) -> None:
        from andrea.tools.sample import sample_line, training_samples

        if not self.sampler.shares_weights:
            self.sampler.load_params(self.engine.to_host(self.model.buf["params"]))
        entry = {"step": step, "samples": training_samples(self.sampler, self.prompts, seed=self.exp.seed, step=step)}
        for sample in entry["samples"]:
            self.log(sample_line(step, sample))  # one line each: the log shows what the model says as it learns
        history = json.loads(self.files.samples.read_text()) if self.files.samples.exists() else []
        history = [h for h in history if h["step"] < step] + [entry]
        write_json_atomic(self.files.samples, history)

    # ---- the loop ----------------------------------------------------------------------------
    def run(self) -> int:
        try:
            return self._train()
        except UntrustedState as fault:
            # an update cannot be undone, so --on-nonfinite skip stops here too
            last = self.book.last_written_checkpoint()
            self.book.event("nonfinite", step=fault.step, detail=str(fault), action="stop")
            self.log(f"{fault}; the last good checkpoint is {'step ' + str(last) if last is not None else 'none'}; "
                     "the run stops")
            return EXIT_NONFINITE
        finally:
            self.book.close()  # however the run ends, no checkpoint write is left going on

    def _stop(self) -> tuple[int, str]:
        """Where this invocation stops and why: the program's end, or earlier by --max-steps / --cpu-max-steps (the
        state says a run is unfinished, and why)."""
        limits = [(self.total_steps, "end"), (self.args.max_steps, "max-steps")]
        if self.engine.name == "numpy":
            limits.append((self.args.cpu_max_steps, "cpu-max-steps"))
        return min((n, why) for n, why in limits if n is not None)

    def _train(self) -> int:
        from andrea.schedule.model import NonFiniteStep

        book = self.book
        book.stop, book.stopped_by = self._stop()  # the state's `unfinished` reads them at each checkpoint
        stop, stopped_by = book.stop, book.stopped_by
        signals = STOP_SIGNALS.install()  # already installed by the command line, unless called from Python
        step = self.start_step(stop)
        self._announce(step, stop, stopped_by)
        if signals.terminate:
            # SIGTERM while starting: nothing was trained here, the last checkpoint (if any) is current
            book.event("sigterm", step=step, detail="before the first step")
            self.log(f"SIGTERM while starting: nothing trained, stopped at step {step}; resume with --resume")
            return self.args.sigterm_exit_code
        book.catch_up_archive(step)
        # durations on a monotonic clock: a wall clock stepped back (NTP, a resumed VM) would make them negative
        t_start = time.perf_counter()
        with Progress(self.console, step, stop, enabled=self.is_main) as progress:
            while step < stop:
                t0 = time.perf_counter()
                phase = self.program.phase_at(step)
                lr = phase.lr_at(step)
                try:
                    with self.spent.on("steps"):
                        loss, norm, mixed = self._step(phase, step, lr)
                    trained = True
                except NonFiniteStep as fault:
                    if not self._skips(fault, step + 1):  # the run stops before the update
                        return EXIT_NONFINITE
                    trained = False
                step += 1
                elapsed = self.elapsed_before + time.perf_counter() - t_start
                if trained:
                    self._after_step(phase, step, loss, lr, norm, time.perf_counter() - t0, elapsed, progress, mixed)
                pivot = step == phase.end and step < self.total_steps
                if pivot:
                    with self.spent.on("checkpoints"):
                        book.pivot(phase, step, elapsed)
                # signals are acted on after every step, a skipped one too
                if self.data_parallel is not None:
                    signals.terminate, signals.snapshot = self.data_parallel.agree(signals.terminate, signals.snapshot)
                if signals.terminate:
                    if not pivot:
                        book.checkpoint(step, elapsed, "SIGTERM")
                    book.settle()
                    self.log(f"SIGTERM: stopped at step {step}; resume with --resume")
                    return self.args.sigterm_exit_code
                every = phase.intervals["checkpoint"]
                with self.spent.on("checkpoints"):
                    if signals.snapshot:
                        signals.snapshot = False
                        if not pivot:
                            book.checkpoint(step, elapsed, "SIGUSR1")
                    elif trained and not pivot and every and step % every == 0 and step < stop:
                        book.checkpoint(step, elapsed, "interval")
                book.settle(wait=False)  # the writes behind the loop that are done: their events and lines
            with self.spent.on("checkpoints"):
                if book.last_checkpoint() != step:  # a pivot wrote it
                    book.checkpoint(step, self.elapsed_before + time.perf_counter() - t_start,
                                    "end" if step == self.total_steps else stopped_by)
                book.settle()
        self.log(self.spent.line(time.perf_counter() - t_start))
        self.log(f"done: step {step} of {self.total_steps}" + ("" if step == self.total_steps else
                 f"; unfinished: stopped by --{stopped_by}; `andrea train --resume`"
                 f"{' on a GPU' if stopped_by == 'cpu-max-steps' else ''} continues it"))
        return 0

    def _announce(self, step: int, stop: int, stopped_by: str) -> None:
        """The log lines that open the training: the steps this invocation runs, of how many."""
        exp = self.exp
        if stop < self.total_steps and stopped_by == "cpu-max-steps":
            self.log(f"the NumPy engine trains the first {stop} of the program's {self.total_steps} steps "
                     "(--cpu-max-steps); `andrea train --resume` on a GPU continues the same program")
        self.log(f"training {exp.name}: steps {step} -> {stop} of {self.total_steps}, "
                 f"{exp.tokens_per_step:,} tokens/step, {self.model.layout.n_params:,} parameters"
                 + (f"; phases {', '.join(f'{p.name} {p.start + 1}-{p.end}' for p in self.program.phases)}"
                    if len(self.program.phases) > 1 else ""))

    def _step(self, phase, step: int, lr: float) -> tuple[float, float, dict]:
        """Step `step` (0-based) on its batch: (loss, gradient norm, the record's per-source fields). A loss or
        gradient norm that is not finite raises NonFiniteStep before the update."""
        exp = self.exp
        probs, windows, sources = self._draw(phase, step)
        rank = self.rank.rank if self.rank else 0
        mine = rank_rows(windows, rank, self.world)
        micro = self.train_windows.micro_batches_of(mine, exp.micro_batches)
        weights = (self.train_windows.micro_weights_of(mine, exp.micro_batches)
                   if phase.loss_on == "assistant" else None)
        by_source = None
        if len(self.mixture.names) > 1:  # each source's training loss, from the step's own losses
            by_source = (np.split(np.array(rank_rows(sources, rank, self.world)), exp.micro_batches),
                         len(self.mixture.names))
        loss, norm = self.model.train_step(micro, step=step, lr=lr, optimizer=exp.optimizer, weights=weights,
                                           sources=by_source)
        return loss, norm, self._account(phase, probs, sources)

    def _skips(self, fault, step: int) -> bool:
        """A step (`step`: the one it would have completed) whose loss or gradient norm is not finite: skipped with
        no update (True), or the run stops (False)."""
        from andrea.schedule.model import LossScaleOverflow

        # An fp16 overflow is part of the loss scale's working, not a fault: always skipped.
        overflow = isinstance(fault, LossScaleOverflow)
        if self.args.on_nonfinite == "stop" and not overflow:
            last = self.book.last_written_checkpoint()
            self.book.event("nonfinite", step=step, detail=str(fault), action="stop")
            self.log(f"step {step}: {fault}; nothing was updated; the last good checkpoint is "
                     f"{'step ' + str(last) if last is not None else 'none'}; rerun with --resume, "
                     "or with --on-nonfinite skip to skip such steps")
            return False
        self.book.skipped_steps.append(step)
        self.book.event("overflow" if overflow else "nonfinite", step=step, detail=str(fault), action="skip")
        self.log(f"step {step}: {fault}; step skipped (no update)")
        return True

    def _draw(self, phase, step: int) -> tuple[list[float] | None, list[int], list[int]]:
        """(probabilities or None, windows, sources) of the step's B rows: the phase's mixing policy's draw
        (which advances the mixing state), else the loader's scheme."""
        if self.mixture.policies[phase.name] is None:
            windows = self.train_windows.batch_windows(step, self.exp.batch_size)
            return None, windows, [self.train_windows.window_source(w) for w in windows]
        probs = self.mixture.probabilities(phase, self.book.mix_state)
        return (probs, *self.mixture.batch(step, probs, self.book.mix_state))

    def _account(self, phase, probs, sources: list[int]) -> dict:
        """After a trained step: rows per source, the bandit's update from each source's training loss, and the
        record's per-source fields."""
        mix_state = self.book.mix_state
        counts = np.bincount(sources, minlength=len(self.mixture.names))
        for k, c in enumerate(counts):
            mix_state.rows[k] += int(c)
        fields = {}
        if self.model.source_loss_sums is not None:  # a step over several sources (see the loop)
            sums, weights = self.model.source_loss_sums
            source_loss = {k: float(sums[k] / weights[k]) for k in range(len(sums)) if weights[k] > 0}
            if probs is not None:
                self.mixture.update(phase, mix_state, probs, source_loss)
                fields["mix"] = self.mixture.named(probs)
            fields["source_loss"] = self.mixture.named(source_loss)
            fields["source_sequences"] = self.mixture.named({k: int(c) for k, c in enumerate(counts) if c})
        return fields

    def _after_step(self, phase, step, loss, lr, norm, dt, elapsed, progress, mixed: dict) -> None:
        """The step's record (validation losses at the eval interval and at the end of each phase), the best
        checkpoint, progress and samples."""
        from andrea.tools.evaluate import source_validation_losses, validation_losses

        exp, iv = self.exp, phase.intervals
        record = {"step": step, "phase": phase.name, "loss": loss, "lr": lr, "grad_norm": norm,
                  "tokens": step * exp.tokens_per_step,
                  "tokens_per_s": exp.tokens_per_step / dt if dt > 0 else None,  # no rate for a step that took no time
                  "time": elapsed, **mixed}
        last = step == phase.end
        if self.is_main and ((iv["eval"] and step % iv["eval"] == 0) or last):
            with self.spent.on("evals"):
                record.update(validation_losses(self.model, self.val_windows, iv["eval_batches"], assistant=self.masks))
                if self.mixture.active:
                    record["val_loss_sources"] = source_validation_losses(self.model, self.val_windows,
                                                                          iv["eval_batches"])
        if self.is_main:
            self.book.append(record)
            with self.spent.on("checkpoints"):
                self.book.offer_best(step, record)
        progress.update(step, record)
        if self.sampler and ((iv["sample"] and step % iv["sample"] == 0) or last):
            with self.spent.on("samples"):
                self.write_samples(step)


class TimeSpent:
    """Where an invocation's training time went, by part: the steps themselves against what the experiment's
    intervals add (evals, samples, checkpoints; a checkpoint's part is what it held the loop: the copy and check of
    the state, and waits for the writes behind the loop). The rest is the loop's own bookkeeping."""

    PARTS = ("steps", "evals", "samples", "checkpoints")

    def __init__(self):
        self.seconds = dict.fromkeys(self.PARTS, 0.0)

    @contextmanager
    def on(self, part: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] += time.perf_counter() - t0

    def line(self, wall: float) -> str:
        parts = ", ".join(f"{part} {s:,.2f}" for part, s in self.seconds.items())
        rest = max(0.0, wall - sum(self.seconds.values()))
        share = self.seconds["steps"] / wall if wall > 0 else 1.0
        return f"time: {wall:,.2f} s of training, steps {share:.1%} of it; s by part: {parts}, the rest {rest:,.2f}"


class Progress:
    """A live bar with loss, tokens/s and ETA on a terminal; else about 20 plain lines on stdout, apart from the
    log lines and memory plan on stderr (the workflow shows stdout and keeps stderr in its log)."""

    def __init__(self, console, start: int, stop: int, enabled: bool = True):
        self.console, self.start, self.stop = console, start, stop
        self.enabled = enabled
        self.live = enabled and console.is_terminal
        self.every = max(1, (stop - start) // 20)
        self.t0 = time.monotonic()

    def __enter__(self):
        if self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeRemainingColumn

            self.bar = Bar(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                           TimeRemainingColumn(), console=self.console)
            self.bar.__enter__()
            self.task = self.bar.add_task("train", total=self.stop, completed=self.start, info="")
        return self

    def __exit__(self, *exc):
        if self.live:
            self.bar.__exit__(*exc)

    def update(self, step: int, rec: dict) -> None:
        info = f"loss {rec['loss']:.4f}"
        if "val_loss" in rec:
            info += f"  val {rec['val_loss']:.4f}"
        info += f"  {rec['tokens_per_s']:,.0f} tok/s" if rec["tokens_per_s"] else ""
        if self.live:
            self.bar.update(self.task, completed=step, info=f"{rec.get('phase', '')}  {info}")
        elif self.enabled and ((step - self.start) % self.every == 0 or step == self.stop):
            done = step - self.start
            eta = (time.monotonic() - self.t0) / max(done, 1) * (self.stop - step)
            self.line(f"step {step}/{self.stop}  phase {rec.get('phase')}  {info}  eta {eta:,.0f}s")

    def line(self, text: str) -> None:
        """One progress line on stdout. A reader that went away (a closed pipe) ends the lines, not the run: stdout
        then goes to /dev/null, so neither a later line nor the flush at exit fails."""
        try:
            print(text, flush=True)
        except OSError:
            self.enabled = False
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError):
                pass


def main(args) -> int:
    from rich.console import Console

    if args.supervise:
        return supervise(args, child_command(args, omit=START_OPTIONS))
    if args.gpus and rank_from_env() is None:
        return launch(child_command(args), args.gpus, args.sigterm_exit_code)
    console = Console(stderr=True)
    if not console.is_terminal:  # a log file: the memory table unwrapped, not cut to 80 columns
        console = Console(stderr=True, width=200)
    try:
        return Trainer(args, console).run()
    except (AndreaError, OSError) as err:
        # the sentence the command line prints, also in NAME.log (when its folder exists)
        try:
            Log(RunFiles(Path(args.out)).log, console).record(f"error: {error_sentence(err)}")
        except OSError:
            pass  # the log's own disk failed: the command line still prints the sentence
        raise
    finally:
        STOP_SIGNALS.restore()
