"""The training loop: `andrea train`.

Outputs for results/NAME.ckpt (see docs/ANDREA.md):
    NAME.ckpt          the seed's checkpoint format, atomic
    NAME.state.json    what the format cannot hold: experiment, step, data, sha256 of the ckpt
    NAME.loss.json     JSON Lines, one record per step (+ event lines); appended, never truncated
    NAME.samples.json  generated text at the sample interval (when a tokenizer is present)
    NAME.log           the run's log lines

SIGTERM: checkpoint at the next step boundary, exit (0 by default) once durable.
SIGUSR1: checkpoint, continue. See docs/RELIABILITY.md for every failure the loop survives.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shlex
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from andrea import __version__
from andrea.atomic import write_json_atomic
from andrea.checkpoint import (check_trainable, checkpoint_digest, read_checkpoint, read_header, read_state,
                               untrusted_values, verify_against_state, write_checkpoint)
from andrea.config import continuation_refusal, load_experiment
from andrea.errors import AndreaError, error_sentence
from andrea.identity import data_fingerprint, record_mismatches, tokenizer_fingerprint
from andrea.inspect_ckpt import refuse_other_model
from andrea.loader import rank_rows
from andrea.memory import device_bytes
from andrea.mixing import Mixture, MixState
from andrea.options import at_least
from andrea.parallel import launch, rank_from_env
from andrea.runfiles import EXIT_NONFINITE, RESTARTS_ENV, RunFiles, append_record, end_torn_line, iter_records
from andrea.stop_signals import STOP_SIGNALS
from andrea.supervise import START_OPTIONS, supervise

STATE_FORMAT = 1
N_SAMPLE_PROMPTS = 3
# How many recent checkpoints .state.json vouches for: a kill between renaming the checkpoint and
# renaming the state leaves a checkpoint that is one of these two.
STATE_CHECKPOINT_HISTORY = 2
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


def add_options(p: argparse.ArgumentParser) -> None:
    """Every option of `andrea train`; child_command() re-emits them for the processes it starts."""
    p.add_argument("--experiment", required=True, help="experiment JSON (config/experiments/ANDREA-*-TRAIN.json)")
    p.add_argument("--data", required=True, help="folder with train.bin, val.bin and optionally tokenizer.json")
    p.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                   help="override one field of the experiment (repeatable): KEY a dotted path, phases by name "
                   "(phases.main.length.steps=2000), other lists by index (optimizer.betas.1=0.99); VALUE JSON when "
                   "it parses, else a string. The run uses, hashes and records the experiment so changed")
    p.add_argument("--out", required=True, help="checkpoint to write, e.g. results/ANDREA-12M.ckpt")
    p.add_argument("--engine", default="auto", choices=("auto", "numpy", "cuda"),
                   help="auto (default) uses CUDA when a device is present, else NumPy")
    p.add_argument("--max-steps", type=at_least(1), default=None,
                   help="stop after this many optimizer steps in total (the LR schedule still spans the full run)")
    p.add_argument("--cpu-max-steps", type=at_least(1), default=None, metavar="N",
                   help="when the run trains on the NumPy engine (no GPU), stop after N steps in total: the first N "
                   "of the same program, which --resume on a GPU continues (the log, the state and `andrea inspect` "
                   "say the run is unfinished)")
    start = p.add_mutually_exclusive_group()
    start.add_argument("--resume", action="store_true",
                       help="continue from --out if it exists and its .state.json matches the experiment "
                       "(starts from step 0 if there is no checkpoint yet)")
    start.add_argument("--init-from", metavar="CKPT", help="start from any checkpoint of this model size (weights, m, v, step)")
    p.add_argument("--switch-data", action="store_true",
                   help="with --resume: continue on --data although the run was trained on other data or another "
                   "tokenizer (without it that is refused); the switch is logged and kept in .state.json")
    p.add_argument("--tokenizer", help="tokenizer.json for samples (default: DATA/tokenizer.json if present)")
    p.add_argument("--on-nonfinite", choices=("stop", "skip"), default="stop",
                   help="a NaN/inf loss or gradient norm: stop before the update (default, exit 3) or skip the step")
    p.add_argument("--sigterm-exit-code", type=int, default=0, metavar="N",
                   help="exit status after a SIGTERM checkpoint (default 0; a workflow that should retry a "
                   "preempted job uses a non-zero one, e.g. 75)")
    p.add_argument("--supervise", action="store_true",
                   help="run training as a child process and restart it from the last checkpoint when it dies "
                   "(crash, SIGKILL, out of memory); SIGTERM/SIGUSR1 are forwarded")
    p.add_argument("--max-restarts", type=int, default=3, help="with --supervise: restarts before giving up (default 3)")
    p.add_argument("--gpus", type=int, default=None, metavar="N",
                   help="data-parallel training on N GPUs of this host through NCCL (one process per GPU; "
                   "under SLURM, srun starts one task per GPU instead); the experiment's batch_size is the global batch")


def child_command(args: argparse.Namespace, omit: tuple[str, ...] = ()) -> list[str]:
    """The `andrea train` command of a trainer process the supervisor or the launcher starts: every
    option of add_options() whose parsed value is not its default, less the supervisor's own and
    those in `omit`, so that an option added there reaches the child with no change here."""
    parser = argparse.ArgumentParser(add_help=False)
    add_options(parser)
    cmd = [sys.executable, "-m", "andrea.cli", "train"]
    for action in parser._actions:  # argparse lists a parser's options only there
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


class UntrustedState(Exception):
    """The model's state holds numbers that cannot be trusted (a NaN weight, m or v; a negative v): nothing of it
    is written, the run stops."""

    def __init__(self, step: int, detail: str):
        super().__init__(detail)
        self.step = step


class Trainer:
    def __init__(self, args, console):
        from andrea.engines import cuda_available, make_engine
        from andrea.loader import TokenWindows
        from andrea.model import Model

        self.args = args
        self.exp = load_experiment(args.experiment, args.set or ())
        self.files = RunFiles(Path(args.out))
        self.files.ckpt.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank_from_env() if args.gpus else None
        self.is_main = self.rank is None or self.rank.is_main
        if self.is_main:
            self._take_lock()
            # refused before the engine and its memory plan are built and printed
            self._refuse_existing_checkpoint()
        torn = self.is_main and end_torn_line(self.files.loss)
        self.log = Log(self.files.log, console) if self.is_main else (lambda msg: None)
        self.console = console
        if torn:
            self.log(f"{self.files.loss}: its last line was cut short (a full disk or a kill); ended it there, "
                     "readers skip it")
        data = Path(args.data)
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
        self.mix_state = MixState.fresh(len(self.train_windows.sources))
        if self.mixture.active:
            self._check_val_sources()
        self.data_record = {"dir": str(data), **data_fingerprint(data, self.train_windows.files + self.val_windows.files)}
        self.tokenizer_path = self._tokenizer_path(args.tokenizer)
        self.tokenizer_record = tokenizer_fingerprint(self.tokenizer_path)
        self.data_history: list[dict] = []  # the data of earlier stretches of a run resumed with --switch-data
        self._data_switch: tuple[str, list[str]] | None = None
        # every refusal of --resume / --init-from comes before the engine and its memory plan are built and printed
        self.start_from = self._check_start()
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
            from andrea.parallel import DataParallel, forget_unique_id, unique_id

            self.data_parallel = DataParallel(self.rank, unique_id(self.rank, self.files))
            forget_unique_id(self.rank, self.files)  # every rank has joined: the id has served
            self.log(f"data parallel: {world} ranks, {self.exp.batch_size // world} sequences per rank per step")
        if self.engine.name == "numpy" and args.engine == "auto" and not cuda_available():
            self.log("engine: numpy (no CUDA device found; the NumPy reference engine runs on the CPU)")
        else:
            built = getattr(self.engine, "kernels_built", 0)
            self.log(f"engine: {self.engine.name}" + (
                f" ({built} kernel files compiled for {self.exp.precision} in {t_engine:.1f} s; later runs on this "
                "machine read them from the cache)" if built else ""))
        self.world = world
        micro = self.exp.batch_size // (world * self.exp.micro_batches)
        self.model = Model(self.engine, shape, micro, data_parallel=self.data_parallel,
                           **model_options(self.exp, self.engine.name))
        self.sampler = None
        self.prompts: list[list[int]] = []
        self._setup_sampling()
        # every buffer on the device: the training model's, and the sampler's (inside it, or beside it)
        plans = [self.model.plan] + ([self.sampler.model.plan] if self.sampler else [])
        where = "inside the training model's memory" if self.sampler and self.sampler.shares_weights else "beside it"
        if self.is_main:
            console.print(self.model.plan.render(f"Memory plan: {self.exp.name}, micro-batch {micro}"))
            if self.sampler:
                console.print(self.sampler.model.plan.render(f"Memory plan: the sampler (micro-batch 1), {where}"))
        self.log(f"memory plan: {device_bytes(*plans):,} bytes in {sum(len(p.buffers) for p in plans)} buffers"
                 + (f" (training model and sampler, {where}; the engine's own buffers once)" if self.sampler else ""))
        self.elapsed_before = 0.0
        self.recent_checkpoints: list[dict] = []
        self.skipped_steps: list[int] = []
        self.best: dict | None = None  # {"step", "metric", "value", "sha256"} of NAME.best.ckpt

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

    def _take_lock(self) -> None:
        """One trainer per run: a second one on the same --out would interleave its writes."""
        self._lock = open(self.files.lock, "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise AndreaError(f"{self.files.ckpt}: another `andrea train` is writing this run; wait for it or stop it") from None
        for stale in self.files.stale_temp_files():
            stale.unlink(missing_ok=True)

    def _tokenizer_path(self, explicit) -> Path | None:
        from andrea.inference import find_tokenizer

        path = find_tokenizer(self.data_dir, explicit)
        if path is not None and not path.is_file():
            raise AndreaError(f"{path}: tokenizer file not found")
        return path

    def _refuse_existing_checkpoint(self) -> None:
        if self.files.ckpt.exists() and not self.args.resume:
            raise AndreaError(
                f"{self.files.ckpt}: a checkpoint is already there; pass --resume to continue it, "
                "or remove it to start over"
            )

    def _setup_sampling(self) -> None:
        from andrea.inference import load_tokenizer
        from andrea.sample import Sampler, validation_prompts

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
    def _check_start(self) -> tuple | None:
        """Everything --resume and --init-from refuse, checked before anything is built: (how, state, step,
        params, m, v) of the checkpoint to start from, or None to start from step 0."""
        files, args = self.files, self.args
        if args.resume and files.ckpt.exists():
            return self._check_resume()
        self._refuse_existing_checkpoint()
        self._refuse_orphaned_run_files()
        if args.init_from:
            step, params, m, v = self._read_verified(Path(args.init_from))
            refuse_other_model(args.init_from, read_state(args.init_from), self.exp,
                               "--init-from takes a checkpoint of this experiment's model shape")
            return "init_from", None, step, params, m, v
        return None

    def _refuse_orphaned_run_files(self) -> None:
        """No checkpoint at --out, but another run's files are there: its state and phase archives are never
        written over. The one exception is a run whose first checkpoint write was cut short (its state went
        first, and no checkpoint was ever completed): the same trajectory on the same data starts over."""
        files = self.files
        archived = sorted(p.name for p in files.archive.iterdir()) if files.archive.is_dir() else []
        if files.state.is_file() and not archived and self.args.resume:
            state = read_state(files.ckpt)
            completed = files.loss.is_file() and any(
                r.get("event") == "checkpoint" for r in iter_records(files.loss))
            if (not completed and state.get("trajectory_hash") == self.exp.trajectory_hash()
                    and not self._data_changes(state)):
                return
        present = ([files.state.name] if files.state.is_file() else []) + \
            ([f"{files.archive.name}/ ({', '.join(archived)})"] if archived else []) + \
            ([files.best.name] if files.best.is_file() and files.state.is_file() else [])
        if present:
            raise AndreaError(
                f"{files.ckpt}: missing, but {', '.join(present)} of a run {'are' if len(present) > 1 else 'is'} there "
                f"(in {files.ckpt.parent}); put its checkpoint back to {'resume' if self.args.resume else 'continue'} it, "
                "or move those files away, or start a new run on another --out: "
                f"`{self.suggest(*(['--init-from', self.args.init_from] if self.args.init_from else []), label='new')}`"
            )

    def start_step(self, stop: int) -> int:
        from andrea.model import init_params

        files, args = self.files, self.args
        if self.start_from is not None and self.start_from[0] == "resume":
            return self._resume(stop)
        if args.resume:
            # Resume before the first checkpoint: start over, keeping the history (later lines win).
            self.log(f"resume: no checkpoint at {files.ckpt} yet; starting from step 0")
        else:
            # Outputs of a run that left no checkpoint: keep them aside, start clean.
            for path in (files.loss, files.samples):
                if path.exists():
                    old = path.with_name(path.name + ".old")
                    path.replace(old)
                    self.log(f"moved {path.name} of a run that left no checkpoint to {old}")
        if files.best.exists() and not files.state.exists():
            # a best checkpoint no state vouches for: its run never completed a checkpoint; kept aside
            old = files.best.with_name(files.best.name + ".old")
            files.best.replace(old)
            self.log(f"moved {files.best.name}, which no state vouches for, to {old}")
        if self.start_from is not None:  # --init-from
            _, _, step, params, m, v = self.start_from
            self.start_from = None
            self.model.load_state(params, m, v)
            self.event("init_from", step=step, checkpoint=str(args.init_from), stop=stop, total_steps=self.total_steps)
            return step
        self.model.load_state(init_params(self.model.layout, self.exp.seed))
        self.event("start", step=0, stop=stop, total_steps=self.total_steps)
        return 0

    def _read_verified(self, path: Path):
        """Read a checkpoint to train on: checked against the .state.json that speaks for it, if any, and for
        numbers that can be trusted."""
        verify_against_state(path)
        step, params, m, v = read_checkpoint(path, self.model_n_params(), f"experiment {self.exp.name}")
        check_trainable(path, params, m, v)
        return step, params, m, v

    def model_n_params(self) -> int:
        from andrea.layout import ParameterLayout

        return ParameterLayout(self.exp.model).n_params

    def _data_changes(self, state: dict) -> list[str]:
        """How the data and tokenizer handed to this run differ from those its state records."""
        changes = record_mismatches(state.get("data") or {}, self.data_record)
        was, now = state.get("tokenizer"), self.tokenizer_record
        if was and (now is None or now["sha256"] != was["sha256"]):
            changes.append(f"tokenizer: trained with sha256 {was['sha256'][:12]}…, now "
                           + (f"sha256 {now['sha256'][:12]}…" if now else "none"))
        return changes

    def suggest(self, *extra: str, out: Path | None = None, label: str = "new") -> str:
        """A command a refusal suggests, one that runs as given: `andrea train` with this invocation's experiment,
        data, overrides and options (less --resume, --init-from and --switch-data), then `extra`, and --out `out`,
        by default a new one beside this run's (NAME-<label>.ckpt) where no run's files are yet."""
        cmd = ["andrea", "train"] + child_command(self.args, omit=("resume", "init_from", "switch_data", "out"))[4:]
        n = 1
        while out is None:
            candidate = self.files.ckpt.with_name(f"{self.files.ckpt.stem}-{label}{'' if n == 1 else f'-{n}'}.ckpt")
            f = RunFiles(candidate)
            if not any(p.exists() for p in (f.ckpt, f.state, f.archive, f.best, f.loss, f.samples)):
                out = candidate
            n += 1
        return shlex.join(cmd + list(extra) + ["--out", str(out)])

    def _init_from_command(self, state: dict | None) -> str:
        """The command that starts a new run from this run's checkpoint, or from scratch when the model it holds
        is not this experiment's (--init-from would refuse it)."""
        model = ((state or {}).get("experiment") or {}).get("model", self.exp.raw["model"])
        if model != self.exp.raw["model"]:
            return f"the model changed, so its weights do not fit; start a new run: `{self.suggest(label='new')}`"
        try:
            step = read_header(self.files.ckpt)[0]
        except AndreaError:
            step = (state or {}).get("step", 0)
        return (f"to start a new run from its weights: "
                f"`{self.suggest('--init-from', str(self.files.ckpt), label=f'from-{step}')}`")

    def _cannot_resume(self, why: str, state: dict | None) -> AndreaError:
        return AndreaError(f"{self.files.ckpt}: cannot resume: {why}; {self._init_from_command(state)}")

    def _check_resume(self) -> tuple:
        files = self.files
        if not files.state.is_file():
            raise AndreaError(
                f"{files.state}: missing, so {files.ckpt} cannot be matched to the experiment; "
                f"{self._init_from_command(None)}"
            )
        state = read_state(files.ckpt)
        if "experiment" in state:
            # the sections that decide every step, before the checkpoint is read (another model's is another size);
            # the steps run are compared once its step is known (_check_phases)
            refusal = continuation_refusal(state["experiment"], self.exp, 0, self.n_train_tokens)
        elif state.get("trajectory_hash") != self.exp.trajectory_hash():
            refusal = "the experiment changed since it was written (its state does not say how)"
        else:
            refusal = None
        if refusal:
            raise self._cannot_resume(refusal, state)
        step, params, m, v = self._read_verified(files.ckpt)
        self._check_phases(state, step)
        changes = self._data_changes(state)
        recorded_dir = (state.get("data") or {}).get("dir", "?")
        if changes and not self.args.switch_data:
            raise AndreaError(
                f"{files.ckpt}: cannot resume: it was trained on {recorded_dir} but --data {self.data_dir} differs "
                f"({'; '.join(changes[:3])}{'; ...' if len(changes) > 3 else ''}); pass the data it was trained on, "
                "or add --switch-data to continue on this data (recorded in its .state.json): "
                f"`{self.suggest('--resume', '--switch-data', out=files.ckpt)}`"
            )
        self.data_history = list(state.get("data_history", []))
        if changes:
            self.data_history.append({"until_step": step, "data": state.get("data"), "tokenizer": state.get("tokenizer")})
            self._data_switch = (recorded_dir, changes)
        return "resume", state, step, params, m, v

    def _resume(self, stop: int) -> int:
        files = self.files
        _, state, step, params, m, v = self.start_from
        self.start_from = None
        self.model.load_state(params, m, v)
        best = state.get("best")
        self.best = best if best and best["step"] <= step else None
        if self.model.loss_scale is not None and "loss_scale" in state:
            self.model.loss_scale.load(state["loss_scale"])
        if self.model.histories:
            self.model.load_histories(state)
        self.recent_checkpoints = [c for c in state.get("checkpoints", []) if c["step"] <= step]
        matched = [c for c in self.recent_checkpoints if c["step"] == step]
        self.elapsed_before = float(matched[-1]["elapsed_s"]) if matched else 0.0
        self.skipped_steps = [s for s in state.get("skipped_steps", []) if s <= step]
        self.mix_state = self._resumed_mixing(matched[-1] if matched else {}, step)
        written_on = state.get("cpu", {}).get("blas")
        now = self._cpu()["blas"] if self.engine.name == "numpy" else None
        if now and written_on and written_on != now:
            self.log(f"resume: written with BLAS {written_on}, now {now}; the thread count does not "
                     "change a CPU run's bytes, but another BLAS library or kernel may (docs/REPRODUCIBILITY.md)")
        self.event("resume", step=step, stop=stop, total_steps=self.total_steps)
        self.log(f"resumed {files.ckpt} at step {step}")
        if self._data_switch:
            before, changes = self._data_switch
            self.event("data_switched", step=step, before=before, now=str(self.data_dir), changes=changes)
            self.log(f"resume: --switch-data: trained on {before} until step {step}, continues on {self.data_dir} "
                     f"({'; '.join(changes)})")
        if state.get("experiment") != self.exp.raw or state.get("overrides", []) != list(self.args.set or []):
            # changed where it may (after the steps run): the state says at once what the run now is (a phase
            # archived before the next checkpoint holds it too)
            write_json_atomic(files.state, self._state(step, self.elapsed_before))
        return step

    def _resumed_mixing(self, entry: dict, step: int) -> MixState:
        """The mixing state of the checkpoint resumed from; a run written before mixing existed drew every batch
        by the loader's scheme, so its rows per source are counted again from the steps it trained."""
        n = len(self.train_windows.sources)
        if "mixing" in entry:
            return MixState.from_json(entry["mixing"], n)
        if self.mixture.active and any(self.mixture.policies[p.name] for p in self.program.phases if p.start < step):
            raise self._cannot_resume(f"its .state.json holds no mixing state for step {step}", None)
        state = MixState.fresh(n)
        skipped = set(self.skipped_steps)
        for s in range(step):
            if s + 1 not in skipped:
                for k in self.train_windows.train_sources(s, self.exp.batch_size):
                    state.rows[k] += 1
        return state

    def _check_phases(self, state: dict, step: int) -> None:
        """Every step already run must be the same step now (config.continuation_refusal: the phase, learning rate,
        loss_on and mixing of each); what changes after `step` is recorded: phases not yet started that changed or
        went (`phases_changed`), and a program made longer (`extended`)."""
        if "experiment" not in state:
            return  # written before states held the experiment: one phase, which the trajectory hash covers
        refusal = continuation_refusal(state["experiment"], self.exp, step, self.n_train_tokens)
        if refusal:
            raise self._cannot_resume(refusal, state)
        written = {p["name"]: p for p in state.get("phases", [])}
        names = {ph.name for ph in self.program.phases}
        changed = [ph.name for ph in self.program.phases
                   if ph.start >= step and (written.get(ph.name) or {}).get("hash") != ph.hash()]
        dropped = [name for name, p in written.items() if p["start"] >= step and name not in names]
        if changed or dropped:
            self.event("phases_changed", step=step, changed=changed, dropped=dropped)
            self.log(f"resume: phases not yet started changed: {', '.join(changed + dropped)}")
        before = state.get("total_steps")
        if before is not None and self.total_steps > before:
            # the steps run are unchanged: the run goes on as the longer experiment run from scratch would
            grown = [ph.name for ph in self.program.phases
                     if ph.start < step and (written.get(ph.name) or {}).get("end") != ph.end]
            self.event("extended", step=step, total_before=before, total_steps=self.total_steps, phases=grown)
            self.log(f"resume: extended from {before} to {self.total_steps} steps"
                     + (f" (phase {', '.join(grown)} made longer)" if grown else ""))

    # ---- outputs -----------------------------------------------------------------------------
    def event(self, name: str, **fields) -> None:
        if self.is_main:
            self._append({"event": name, "wall": time.time(), **fields})

    def _append(self, record: dict) -> None:
        try:
            append_record(self.files.loss, record)
        except OSError as err:
            last = self.recent_checkpoints[-1]["step"] if self.recent_checkpoints else None
            survivor = f"the checkpoint of step {last} ({self.files.ckpt}) is intact" if last is not None \
                else "no checkpoint was written yet"
            raise AndreaError(
                f"{self.files.loss}: could not append to the loss history ({err.strerror or err}); {survivor}; "
                "free space or fix the disk, then rerun with --resume (a cut-short line is ended and skipped)"
            ) from None

    def _trusted_host_state(self, step: int, what: str):
        """(params, m, v) on the host, refused when they hold a NaN or a negative v: such an update went through
        a finite loss and gradient norm (from state that was already bad), and is never written."""
        params, m, v = self.model.host_state()
        fault = untrusted_values(params, m, v)
        if fault:
            raise UntrustedState(step, f"step {step}: {fault} in the model's state; "
                                       f"the {what} was not written")
        return params, m, v

    def checkpoint(self, step: int, elapsed: float, reason: str) -> None:
        """Write checkpoint + state so that a kill at any instant leaves a pair that resumes:
        the state is written first and vouches for both the new and the previous checkpoint."""
        if not self.is_main:
            return
        params, m, v = self._trusted_host_state(step, "checkpoint")
        digest = checkpoint_digest(step, params, m, v)
        # the mixing state goes with each checkpoint: the state file may vouch for the one before this one too
        entry = {"step": step, "sha256": digest, "elapsed_s": elapsed, "mixing": self.mix_state.to_json(),
                 "tokens_per_source": self._tokens_per_source()}
        self.recent_checkpoints = [c for c in self.recent_checkpoints if c["step"] != step][-(STATE_CHECKPOINT_HISTORY - 1):] + [entry]
        try:
            write_json_atomic(self.files.state, self._state(step, elapsed))
            write_checkpoint(self.files.ckpt, step, params, m, v)
        except OSError as err:
            previous = f"the previous checkpoint (step {self.recent_checkpoints[-2]['step']}) is intact" \
                if len(self.recent_checkpoints) > 1 else "no earlier checkpoint exists"
            raise AndreaError(
                f"{err.filename or self.files.ckpt}: could not write the step-{step} checkpoint "
                f"({err.strerror or err}); {previous}; free space or fix the disk, then rerun with --resume"
            ) from None
        self.event("checkpoint", step=step, reason=reason)
        self.log(f"checkpoint: step {step} -> {self.files.ckpt} ({reason})")

    def _state(self, step: int, elapsed: float) -> dict:
        return {
            "format": STATE_FORMAT,
            "andrea_version": __version__,
            "experiment_path": self.exp.path,
            "experiment": self.exp.raw,  # the effective experiment: the file with the overrides applied
            "overrides": list(self.args.set or []),  # the --set items, as given
            "trajectory_hash": self.exp.trajectory_hash(),
            "step": step,
            "total_steps": self.total_steps,
            # why a checkpoint before the program's end is the last of this invocation (None: the run goes on)
            "unfinished": None if step >= self.total_steps or step < self.stop else self.stopped_by,
            "samples_seen": step * self.exp.batch_size,
            "tokens_seen": step * self.exp.tokens_per_step,
            "data": self.data_record,
            # the train split's tokens: the program's lengths in epochs (config.continuation_refusal) count from it
            "train_tokens": self.n_train_tokens,
            "tokenizer": self.tokenizer_record,
            **({"data_history": self.data_history} if self.data_history else {}),
            "batch_scheme": "window permutation per epoch from PCG64(seed, epoch); see andrea/loader.py",
            "phases": [{"name": p.name, "start": p.start, "end": p.end, "hash": p.hash(), "loss_on": p.loss_on,
                        "status": "finished" if p.end <= step else "running" if p.start < step else "waiting"}
                       for p in self.program.phases],
            "phase": self.program.phase_at(min(step, self.total_steps - 1)).name,
            "mixing": self.mix_state.to_json(),
            "tokens_per_source": self._tokens_per_source(),
            "best": self.best,
            "best_previous": None,
            "engine": self.engine.name,
            **({"cpu": self._cpu()} if self.engine.name == "numpy" else {}),
            "n_params": self.model.layout.n_params,
            "checkpoints": self.recent_checkpoints,
            "skipped_steps": self.skipped_steps,
            **({"loss_scale": self.model.loss_scale.state()} if self.model.loss_scale else {}),
            **self.model.history_state(),
            "restarts": int(os.environ.get(RESTARTS_ENV, "0")),
            "elapsed_s": elapsed,
            "written_at": datetime.now(timezone.utc).isoformat(),
        }

    def _tokens_per_source(self) -> dict:
        """Train tokens (targets) each source gave to the steps trained so far."""
        names = self.mixture.names
        return {names[k]: rows * self.exp.model.seq_len for k, rows in enumerate(self.mix_state.rows)}

    def _cpu(self) -> dict:
        """What a CPU run's bytes depend on: NumPy, its BLAS and how products are cut (not the thread count)."""
        return self.engine.products.describe()

    def write_samples(self, step: int) -> None:
        from andrea.sample import sample_line, training_samples

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
            last = self._last_checkpoint()
            self.event("nonfinite", step=fault.step, detail=str(fault), action="stop")
            self.log(f"{fault}; the last good checkpoint is {'step ' + str(last) if last is not None else 'none'}; "
                     "the run stops")
            return EXIT_NONFINITE

    def _stop(self) -> tuple[int, str]:
        """Where this invocation stops and why: the program's end, or earlier by --max-steps / --cpu-max-steps (the
        state says a run is unfinished, and why)."""
        limits = [(self.total_steps, "end"), (self.args.max_steps, "max-steps")]
        if self.engine.name == "numpy":
            limits.append((self.args.cpu_max_steps, "cpu-max-steps"))
        return min((n, why) for n, why in limits if n is not None)

    def _last_checkpoint(self) -> int | None:
        return self.recent_checkpoints[-1]["step"] if self.recent_checkpoints else None

    def _train(self) -> int:
        from andrea.model import LossScaleOverflow, NonFiniteStep

        exp, model = self.exp, self.model
        self.stop, self.stopped_by = self._stop()  # the state's `unfinished` reads them at each checkpoint
        stop = self.stop
        signals = STOP_SIGNALS.install()  # already installed by the command line, unless called from Python
        step = self.start_step(stop)
        if stop < self.total_steps and self.stopped_by == "cpu-max-steps":
            self.log(f"the NumPy engine trains the first {stop} of the program's {self.total_steps} steps "
                     "(--cpu-max-steps); `andrea train --resume` on a GPU continues the same program")
        self.log(f"training {exp.name}: steps {step} -> {stop} of {self.total_steps}, "
                 f"{exp.tokens_per_step:,} tokens/step, {model.layout.n_params:,} parameters"
                 + (f"; phases {', '.join(f'{p.name} {p.start + 1}-{p.end}' for p in self.program.phases)}"
                    if len(self.program.phases) > 1 else ""))
        if signals.terminate:
            # SIGTERM while starting: nothing was trained here, the last checkpoint (if any) is current
            self.event("sigterm", step=step, detail="before the first step")
            self.log(f"SIGTERM while starting: nothing trained, stopped at step {step}; resume with --resume")
            return self.args.sigterm_exit_code
        self._catch_up_archive(step)
        # durations on a monotonic clock: a wall clock stepped back (NTP, a resumed VM) would make them negative
        t_start = time.perf_counter()
        with Progress(self.console, step, stop, enabled=self.is_main) as progress:
            while step < stop:
                t0 = time.perf_counter()
                phase = self.program.phase_at(step)
                iv = phase.intervals
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
                lr = phase.lr_at(step)
                trained = True
                try:
                    loss, norm = model.train_step(micro, step=step, lr=lr, optimizer=exp.optimizer, weights=weights,
                                                  sources=by_source)
                    mixed = self._account(phase, probs, sources)
                except NonFiniteStep as fault:
                    # An fp16 overflow is part of the loss scale's working, not a fault: always skipped.
                    overflow = isinstance(fault, LossScaleOverflow)
                    if self.args.on_nonfinite == "stop" and not overflow:
                        last = self.recent_checkpoints[-1]["step"] if self.recent_checkpoints else None
                        self.event("nonfinite", step=step + 1, detail=str(fault), action="stop")
                        self.log(f"step {step + 1}: {fault}; nothing was updated; the last good checkpoint is "
                                 f"{'step ' + str(last) if last is not None else 'none'}; rerun with --resume, "
                                 "or with --on-nonfinite skip to skip such steps")
                        return EXIT_NONFINITE
                    self.skipped_steps.append(step + 1)
                    self.event("overflow" if overflow else "nonfinite", step=step + 1, detail=str(fault), action="skip")
                    self.log(f"step {step + 1}: {fault}; step skipped (no update)")
                    trained = False
                step += 1
                elapsed = self.elapsed_before + time.perf_counter() - t_start
                if trained:
                    self._after_step(phase, step, loss, lr, norm, time.perf_counter() - t0, elapsed, progress, mixed)
                pivot = step == phase.end and step < self.total_steps
                if pivot:
                    self._pivot(phase, step, elapsed)
                # signals are acted on after every step, a skipped one too
                if self.data_parallel is not None:
                    signals.terminate, signals.snapshot = self.data_parallel.agree(signals.terminate, signals.snapshot)
                if signals.terminate:
                    if not pivot:
                        self.checkpoint(step, elapsed, "SIGTERM")
                    self.log(f"SIGTERM: stopped at step {step}; resume with --resume")
                    return self.args.sigterm_exit_code
                if signals.snapshot:
                    signals.snapshot = False
                    if not pivot:
                        self.checkpoint(step, elapsed, "SIGUSR1")
                elif trained and not pivot and iv["checkpoint"] and step % iv["checkpoint"] == 0 and step < stop:
                    self.checkpoint(step, elapsed, "interval")
            if not (self.recent_checkpoints and self.recent_checkpoints[-1]["step"] == step):  # a pivot wrote it
                self.checkpoint(step, self.elapsed_before + time.perf_counter() - t_start,
                                "end" if step == self.total_steps else self.stopped_by)
        self.log(f"done: step {step} of {self.total_steps}" + ("" if step == self.total_steps else
                 f"; unfinished: stopped by --{self.stopped_by}; `andrea train --resume`"
                 f"{' on a GPU' if self.stopped_by == 'cpu-max-steps' else ''} continues it"))
        return 0

    def _draw(self, phase, step: int) -> tuple[list[float] | None, list[int], list[int]]:
        """(probabilities or None, windows, sources) of the step's B rows: the phase's mixing policy's draw
        (which advances the mixing state), else the loader's scheme."""
        if self.mixture.policies[phase.name] is None:
            windows = self.train_windows.batch_windows(step, self.exp.batch_size)
            return None, windows, [self.train_windows.window_source(w) for w in windows]
        probs = self.mixture.probabilities(phase, self.mix_state)
        return (probs, *self.mixture.batch(step, probs, self.mix_state))

    def _account(self, phase, probs, sources: list[int]) -> dict:
        """After a trained step: rows per source, the bandit's update from each source's training loss, and the
        record's per-source fields."""
        counts = np.bincount(sources, minlength=len(self.mixture.names))
        for k, c in enumerate(counts):
            self.mix_state.rows[k] += int(c)
        fields = {}
        if self.model.source_loss_sums is not None:  # a step over several sources (see the loop)
            sums, weights = self.model.source_loss_sums
            source_loss = {k: float(sums[k] / weights[k]) for k in range(len(sums)) if weights[k] > 0}
            if probs is not None:
                self.mixture.update(phase, self.mix_state, probs, source_loss)
                fields["mix"] = self.mixture.named(probs)
            fields["source_loss"] = self.mixture.named(source_loss)
            fields["source_sequences"] = self.mixture.named({k: int(c) for k, c in enumerate(counts) if c})
        return fields

    def _after_step(self, phase, step, loss, lr, norm, dt, elapsed, progress, mixed: dict) -> None:
        """The step's record (validation losses at the eval interval and at the end of each phase), the best
        checkpoint, progress and samples."""
        from andrea.evaluate import source_validation_losses, validation_loss

        exp, iv = self.exp, phase.intervals
        record = {"step": step, "phase": phase.name, "loss": loss, "lr": lr, "grad_norm": norm,
                  "tokens": step * exp.tokens_per_step,
                  "tokens_per_s": exp.tokens_per_step / dt if dt > 0 else None,  # no rate for a step that took no time
                  "time": elapsed, **mixed}
        last = step == phase.end
        if self.is_main and ((iv["eval"] and step % iv["eval"] == 0) or last):
            record["val_loss"] = validation_loss(self.model, self.val_windows, iv["eval_batches"])
            if self.masks:
                record["val_loss_assistant"] = validation_loss(self.model, self.val_windows, iv["eval_batches"],
                                                               assistant=True)
            if self.mixture.active:
                record["val_loss_sources"] = source_validation_losses(self.model, self.val_windows, iv["eval_batches"])
        if self.is_main:
            self._append(record)
            if self.headline in record and (self.best is None or record[self.headline] < self.best["value"]):
                self._write_best(step, record[self.headline])
        progress.update(step, record)
        if self.sampler and ((iv["sample"] and step % iv["sample"] == 0) or last):
            self.write_samples(step)

    def _write_best(self, step: int, value: float) -> None:
        """NAME.best.ckpt (the seed's format) at the best headline validation loss so far. The state on disk is
        told first (its `best`, the one before kept as `best_previous`), so a kill at any instant leaves a best
        checkpoint the state vouches for."""
        params, m, v = self._trusted_host_state(step, "best checkpoint")
        previous, self.best = self.best, {"step": step, "metric": self.headline, "value": value,
                                          "sha256": checkpoint_digest(step, params, m, v)}
        if self.files.state.is_file():
            state = read_state(self.files.ckpt)
            write_json_atomic(self.files.state, {**state, "best": self.best, "best_previous": previous})
        write_checkpoint(self.files.best, step, params, m, v)
        self.event("best", step=step, val_loss=value, metric=self.headline)

    def _pivot(self, phase, step: int, elapsed: float) -> None:
        """The end of a phase followed by another: its checkpoint, as SIGUSR1 writes one, then its archive."""
        self.checkpoint(step, elapsed, "pivot")
        self._archive(phase)
        self._pivot_event(phase, step)

    def _pivot_event(self, phase, step: int) -> None:
        nxt = self.program.phase_at(step)
        self.event("pivot", step=step, **{"from": phase.name, "to": nxt.name})
        self.log(f"pivot: phase {phase.name} done at step {step}; archived in {self.files.phase_archive(phase.name)}; "
                 f"phase {nxt.name} starts")

    def _archive(self, phase) -> None:
        """NAME.archive/<phase>/: the checkpoint, samples and state at the phase's end (the loss history runs
        on, never archived). Written beside, then renamed into place: a kill leaves no half archive."""
        if not self.is_main:
            return
        final = self.files.phase_archive(phase.name)
        tmp = final.with_name(f".{final.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for path in (self.files.ckpt, self.files.samples, self.files.state):
            if path.is_file():
                shutil.copy2(path, tmp / path.name)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)

    def _catch_up_archive(self, step: int) -> None:
        """A run stopped at a pivot before its archive was written (a kill, or --max-steps there) archives it now:
        its checkpoint is the phase's end."""
        for phase in self.program.phases:
            archived = self.files.phase_archive(phase.name).is_dir()
            if phase.end == step < self.total_steps and not archived and self.files.ckpt.is_file():
                self._archive(phase)
                self._pivot_event(phase, step)


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
