"""Where `andrea train` starts from, and everything --resume and --init-from refuse.

Every refusal comes before the engine and its memory plan are built and printed, with one sentence that names
what is wrong and a command that runs as given (docs/RELIABILITY.md, "What each consumer checks").
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from andrea.store.checkpoint import check_trainable, read_checkpoint, read_header, read_state, verify_against_state
from andrea.spec.config import continuation_refusal
from andrea.common.errors import AndreaError
from andrea.store.identity import record_mismatches
from andrea.tools.inspect_ckpt import refuse_other_model
from andrea.store.runfiles import RunFiles, iter_records


@dataclass
class Start:
    """The checkpoint a run starts from, read and checked: `how` is "resume" or "init_from"."""

    how: str
    state: dict | None
    step: int
    params: np.ndarray
    m: np.ndarray
    v: np.ndarray
    data_history: list[dict] = field(default_factory=list)  # the state's, with the data left now (--switch-data)
    data_switch: tuple[str, list[str]] | None = None  # (the folder trained on, how the data differ) of --switch-data


def refuse_existing_checkpoint(files: RunFiles, resume: bool) -> None:
    if files.ckpt.exists() and not resume:
        raise AndreaError(
            f"{files.ckpt}: a checkpoint is already there; pass --resume to continue it, "
            "or remove it to start over"
        )


def read_verified(path: Path, exp):
    """Read a checkpoint to train on: checked against the .state.json that speaks for it, if any, and for
    numbers that can be trusted."""
    from andrea.spec.layout import ParameterLayout

    verify_against_state(path)
    step, params, m, v = read_checkpoint(path, ParameterLayout(exp.model).n_params, f"experiment {exp.name}")
    check_trainable(path, params, m, v)
    return step, params, m, v


class StartChecks:
    """The checks of one invocation. `command` is its `andrea train` command less --resume, --init-from,
    --switch-data and --out (what a refusal suggests starts from it); `event` and `log` record what a resume
    finds changed after the steps it ran."""

    def __init__(self, args, exp, program, files: RunFiles, data_dir: Path, data_record: dict,
                 tokenizer_record: dict | None, train_tokens: int, command: list[str], event, log):
        self.args, self.exp, self.program, self.files = args, exp, program, files
        self.data_dir, self.data_record, self.tokenizer_record = data_dir, data_record, tokenizer_record
        self.train_tokens, self.command = train_tokens, command
        self.event, self.log = event, log

    def check(self) -> Start | None:
        """Everything --resume and --init-from refuse, checked before anything is built: the checkpoint to start
        from, or None to start from step 0."""
        files, args = self.files, self.args
        if args.resume and files.ckpt.exists():
            return self._check_resume()
        refuse_existing_checkpoint(files, args.resume)
        self._refuse_orphaned_run_files()
        if args.init_from:
            step, params, m, v = read_verified(Path(args.init_from), self.exp)
            refuse_other_model(args.init_from, read_state(args.init_from), self.exp,
                               "--init-from takes a checkpoint of this experiment's model shape")
            return Start("init_from", None, step, params, m, v)
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

    def _check_resume(self) -> Start:
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
            refusal = continuation_refusal(state["experiment"], self.exp, 0, self.train_tokens)
        elif state.get("trajectory_hash") != self.exp.trajectory_hash():
            refusal = "the experiment changed since it was written (its state does not say how)"
        else:
            refusal = None
        if refusal:
            raise self.cannot_resume(refusal, state)
        step, params, m, v = read_verified(files.ckpt, self.exp)
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
        start = Start("resume", state, step, params, m, v, data_history=list(state.get("data_history", [])))
        if changes:
            start.data_history.append({"until_step": step, "data": state.get("data"), "tokenizer": state.get("tokenizer")})
            start.data_switch = (recorded_dir, changes)
        return start

    def _check_phases(self, state: dict, step: int) -> None:
        """Every step already run must be the same step now (config.continuation_refusal: the phase, learning rate,
        loss_on and mixing of each); what changes after `step` is recorded: phases not yet started that changed or
        went (`phases_changed`), and a program made longer (`extended`)."""
        if "experiment" not in state:
            return  # written before states held the experiment: one phase, which the trajectory hash covers
        refusal = continuation_refusal(state["experiment"], self.exp, step, self.train_tokens)
        if refusal:
            raise self.cannot_resume(refusal, state)
        program = self.program
        written = {p["name"]: p for p in state.get("phases", [])}
        names = {ph.name for ph in program.phases}
        changed = [ph.name for ph in program.phases
                   if ph.start >= step and (written.get(ph.name) or {}).get("hash") != ph.hash()]
        dropped = [name for name, p in written.items() if p["start"] >= step and name not in names]
        if changed or dropped:
            self.event("phases_changed", step=step, changed=changed, dropped=dropped)
            self.log(f"resume: phases not yet started changed: {', '.join(changed + dropped)}")
        before = state.get("total_steps")
        if before is not None and program.total_steps > before:
            # the steps run are unchanged: the run goes on as the longer experiment run from scratch would
            grown = [ph.name for ph in program.phases
                     if ph.start < step and (written.get(ph.name) or {}).get("end") != ph.end]
            self.event("extended", step=step, total_before=before, total_steps=program.total_steps, phases=grown)
            self.log(f"resume: extended from {before} to {program.total_steps} steps"
                     + (f" (phase {', '.join(grown)} made longer)" if grown else ""))

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
        n = 1
        while out is None:
            candidate = self.files.ckpt.with_name(f"{self.files.ckpt.stem}-{label}{'' if n == 1 else f'-{n}'}.ckpt")
            f = RunFiles(candidate)
            if not any(p.exists() for p in (f.ckpt, f.state, f.archive, f.best, f.loss, f.samples)):
                out = candidate
            n += 1
        return shlex.join(self.command + list(extra) + ["--out", str(out)])

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

    def cannot_resume(self, why: str, state: dict | None) -> AndreaError:
        return AndreaError(f"{self.files.ckpt}: cannot resume: {why}; {self._init_from_command(state)}")
