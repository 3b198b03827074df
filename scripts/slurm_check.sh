#!/usr/bin/env bash
# Run the workflow on ANDREA-tiny through a real SLURM cluster: one node on localhost with a
# scheduling-only GPU, started here without systemd (Debian's slurm-wlm + munge, installed when
# missing). Then check that every non-local job went through sbatch: a SLURM job id in the plugin's
# log, a SLURM log file, a clean completion in slurmctld's log, and a GPU request for train and eval.
# Stops what it started, also on failure. Needs root (apt-get, daemons).
#
#   scripts/slurm_check.sh            # exit 0: passed; 77: SLURM cannot be installed here
#
# KEEP=1 keeps the scratch folder (cluster state, logs, the run's results) for inspection.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
VENV_BIN=${VENV_BIN:-$REPO/.venv/bin}
SKIP=77
export PATH=$PATH:/usr/sbin:/sbin # the daemons live there
TIMEOUT_S=${TIMEOUT_S:-900}

say() { echo "slurm_check: $*" >&2; }
skip() { say "skipped: $*"; exit "$SKIP"; }

[[ $(id -u) -eq 0 ]] || skip "needs root to install slurm-wlm and munge and to start their daemons"
[[ -x $VENV_BIN/snakemake ]] || { say "$VENV_BIN/snakemake not found; run scripts/setup.sh --test"; exit 1; }
"$VENV_BIN/python" -c "import snakemake_executor_plugin_slurm" 2>/dev/null ||
  { say "snakemake-executor-plugin-slurm missing; run scripts/setup.sh --test"; exit 1; }

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  command -v apt-get >/dev/null || skip "slurm-wlm is not installed and there is no apt-get"
  say "installing slurm-wlm and munge"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge; } >&2 ||
    skip "apt-get could not install slurm-wlm and munge"
fi

BASE=$(mktemp -d /tmp/andrea-slurm.XXXXXX)
# Jobs' own srun calls read /etc/slurm (SLURM_CONF does not reach them): ours goes there for the
# run, and what was there before comes back afterwards.
ETC=/etc/slurm
STARTED_MUNGED=""

stop_cluster() {
  local status=$?
  set +e
  # Jobs run under slurmstepd, which outlives slurmd: cancel them while the controller still runs.
  [[ -f $BASE/slurmctld.pid ]] && scancel --quiet --user root 2>/dev/null && sleep 1
  for daemon in slurmd slurmctld; do
    if [[ -f $BASE/$daemon.pid ]]; then
      kill "$(cat "$BASE/$daemon.pid")" 2>/dev/null
      wait "$(cat "$BASE/$daemon.pid")" 2>/dev/null
    fi
  done
  [[ -n $STARTED_MUNGED ]] && kill "$STARTED_MUNGED" 2>/dev/null
  for conf in slurm.conf gres.conf; do
    rm -f "$ETC/$conf"
    if [[ -e $BASE/etc.orig/$conf ]]; then mv "$BASE/etc.orig/$conf" "$ETC/$conf"; fi
  done
  if [[ $status -eq 0 && -z ${KEEP:-} ]]; then
    rm -rf "$BASE"
  else
    say "kept $BASE (cluster logs in $BASE/log, the run in $BASE/work)"
  fi
  exit "$status"
}
trap stop_cluster EXIT
trap 'exit 130' INT TERM

H=$(hostname -s)
N=$(nproc)
MEM=$(($(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo) - 1024))
mkdir -p "$BASE"/{etc.orig,state,spool,log} "$ETC"
for conf in slurm.conf gres.conf; do
  if [[ -e $ETC/$conf ]]; then mv "$ETC/$conf" "$BASE/etc.orig/$conf"; fi
done
# proctrack/linuxproc: the default cgroup tracking breaks every job launch without systemd.
# A fresh StateSaveLocation: a drained node would otherwise stay drained across runs.
cat >"$ETC/slurm.conf" <<EOF
ClusterName=andrea-check
SlurmctldHost=$H
ProctrackType=proctrack/linuxproc
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000
MpiDefault=none
MailProg=/bin/true
StateSaveLocation=$BASE/state
SlurmdSpoolDir=$BASE/spool
SlurmctldPidFile=$BASE/slurmctld.daemon.pid
SlurmdPidFile=$BASE/slurmd.daemon.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd.log
GresTypes=gpu
NodeName=$H NodeAddr=127.0.0.1 CPUs=$N RealMemory=$MEM Gres=gpu:1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
# A GPU for scheduling only: --gpus=1 jobs are accepted and run one at a time. Without File=
# the node drains.
echo "NodeName=$H Name=gpu File=/dev/null" >"$ETC/gres.conf"

wait_for() { # SECONDS DESCRIPTION COMMAND...
  local deadline=$((SECONDS + $1)) what=$2
  shift 2
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || { say "timed out waiting for $what; see $BASE/log"; exit 1; }
    sleep 1
  done
}

if scontrol ping 2>/dev/null | grep -q UP; then
  say "a SLURM controller already answers on this host; stop it first"
  exit 1
fi
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  mkdir -p /run/munge && chown munge:munge /run/munge && rm -f /run/munge/munged.pid
  runuser -u munge -- /usr/sbin/munged --force
  wait_for 10 munged test -s /run/munge/munged.pid
  STARTED_MUNGED=$(cat /run/munge/munged.pid)
fi
slurmctld -D >"$BASE/log/slurmctld.out" 2>&1 &
echo $! >"$BASE/slurmctld.pid"
wait_for 30 slurmctld bash -c "scontrol ping | grep -q UP"
slurmd -D >"$BASE/log/slurmd.out" 2>&1 &
echo $! >"$BASE/slurmd.pid"
wait_for 30 "node $H idle" bash -c "sinfo -h -o %T | grep -qx idle"
say "cluster up: node $H, $N CPUs, $MEM MB, gres gpu:1"

# The workflow in a scratch copy, so the repository's results/ stay untouched.
WORK=$BASE/work
mkdir -p "$WORK"
cp -r "$REPO"/{Snakefile,workflow,config,profiles,andrea,kernels} "$WORK"/
cd "$WORK"
say "running the workflow on ANDREA-tiny through profiles/slurm"
# SIGKILL: a hung executor plugin ignores SIGTERM.
if ! HF_HUB_OFFLINE=1 timeout -s KILL "$TIMEOUT_S" "$VENV_BIN/snakemake" \
  --workflow-profile profiles/slurm --config 'experiments=[ANDREA-tiny]' \
  --set-resources train:mem_mb=1000 eval:mem_mb=1000 \
  --slurm-keep-successful-logs >"$BASE/snakemake.out" 2>&1; then
  tail -n 40 "$BASE/snakemake.out" >&2
  say "the workflow failed under SLURM; full output: $BASE/snakemake.out"
  exit 1
fi

"$VENV_BIN/python" - "$BASE/snakemake.out" "$BASE/log/slurmctld.log" <<'EOF'
"""Every job Snakemake ran remotely has a SLURM job id, a SLURM log and a clean completion;
the GPU rules were given the node's GPU."""
import re
import subprocess
import sys
from pathlib import Path

out, ctld = (Path(p).read_text() for p in sys.argv[1:])
jobs = {}  # snakemake job id -> (rule, local?)
for kind, rule, body in re.findall(r"^(localrule|rule) (\w+):\n((?:    .*\n)+)", out, re.M):
    jobid = re.search(r"^    jobid: (\d+)", body, re.M).group(1)
    jobs[jobid] = (rule, kind == "localrule")
submitted = dict(re.findall(r"Job (\d+) has been submitted with SLURM jobid (\d+)", out))
local_rules = {"pull_hermes3", "data_identity", "plot_loss", "eval_table", "all"}
problems = []
print(f"{'rule':<16} {'job':>4}  SLURM job id")
for jobid, (rule, local) in sorted(jobs.items(), key=lambda item: int(item[0])):
    slurm_id = submitted.get(jobid)
    print(f"{rule:<16} {jobid:>4}  {slurm_id or '(local rule)'}")
    if local:
        if rule not in local_rules:
            problems.append(f"{rule} ran locally, but only {sorted(local_rules)} may")
    elif slurm_id is None:
        problems.append(f"{rule} (job {jobid}) has no SLURM job id")
    elif not list(Path(".snakemake/slurm_logs").rglob(f"{slurm_id}.log")):
        problems.append(f"{rule}: no SLURM log .snakemake/slurm_logs/**/{slurm_id}.log")
    elif not re.search(rf"_job_complete: JobId={slurm_id} WEXITSTATUS 0", ctld):
        problems.append(f"{rule}: slurmctld does not report SLURM job {slurm_id} completed with status 0")
    elif rule in ("train", "eval"):
        job = subprocess.run(["scontrol", "-o", "show", "job", slurm_id], capture_output=True, text=True).stdout
        # The node has one GPU, so a job that asked for one ran holding it.
        if "TresPerJob=gres:gpu:1" not in job:
            problems.append(f"{rule}: SLURM job {slurm_id} was not given a GPU: {job.strip()}")
remote = {rule for rule, local in jobs.values() if not local}
expected = {"prep_megachat", "train_tokenizer", "tokenize", "train", "eval"}
if remote != expected:
    problems.append(f"rules run through SLURM: {sorted(remote)}; expected {sorted(expected)}")
for path in ("results/ANDREA-tiny.ckpt", "results/eval/ANDREA-tiny.json", "results/report/evaluation.html"):
    if not Path(path).is_file():
        problems.append(f"{path} was not made")
if problems:
    sys.exit("slurm_check: FAILED\n  " + "\n  ".join(problems))
print(f"slurm_check: passed: {len(remote)} rules, {len(submitted)} jobs through SLURM, "
      f"{sum(local for _, local in jobs.values())} local")
EOF
