#!/bin/bash
# A real Slurm on this machine, for the sbatch scripts' sake:
#
#   sudo bash scripts/slurm/local-cluster-test.sh [path/to/trainrun]
#
# Installs Debian's slurmctld, slurmd, slurm-client and munge (if missing),
# writes a one-node slurm.conf into a scratch directory (SLURM_CONF points at
# it: /etc/slurm is left alone; two free ports), starts munged, slurmctld
# and slurmd, and then for each mode (one agent per node via train.sbatch;
# direct workers via multinode.sbatch with TRAINRUN_SLURM_MODE=direct):
#   1. submits the script with a small CPU job (synthetic data, checkpoints),
#   2. waits until it trains, sends `scancel --signal=USR1`,
#   3. checks that trainrun saved a checkpoint and exited 75, that
#      scripts/slurm/requeue requeued the job, and that the requeued run
#      resumed from the checkpoint and finished every step.
# Stops the daemons and removes the scratch directory on exit, whatever
# happened. Exit 0 when both modes pass. Used by tests/test_slurm.cpp.
set -euo pipefail

here=$(cd "$(dirname "$0")/../.." && pwd)
trainrun=$(realpath "${1:-$here/build/trainrun}")
[ "$(id -u)" = 0 ] || { echo "local-cluster-test: needs root (installs packages, starts daemons)" >&2; exit 2; }
[ -x "$trainrun" ] || { echo "local-cluster-test: no trainrun binary at $trainrun" >&2; exit 2; }

say() { echo "local-cluster-test: $*" >&2; }
fail() { say "FAILED: $*"; exit 1; }

# ---- packages ------------------------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null ||
   ! command -v munged >/dev/null; then
  say "installing slurmctld slurmd slurm-client munge"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null ||
    { apt-get update >/dev/null && apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null; }
fi

# ---- scratch, config, daemons ---------------------------------------------------------------
scratch=$(mktemp -d /tmp/trainrun-slurm-XXXXXX)
chmod 755 "$scratch"
pids=()
cleanup() {
  set +e
  if [ -n "${SLURM_CONF:-}" ]; then
    scancel --full --signal=KILL --state=RUNNING "--name=trn-local-test" >/dev/null 2>&1
    scontrol shutdown >/dev/null 2>&1
    sleep 1
  fi
  for f in "$scratch"/slurmctld.pid "$scratch"/slurmd.pid "$scratch"/munged.pid; do
    [ -s "$f" ] && kill "$(cat "$f")" 2>/dev/null
  done
  sleep 0.5
  for f in "$scratch"/slurmctld.pid "$scratch"/slurmd.pid "$scratch"/munged.pid; do
    [ -s "$f" ] && kill -9 "$(cat "$f")" 2>/dev/null
  done
  if [ -z "${TRAINRUN_KEEP_TEST_DIRS:-}" ]; then rm -rf "$scratch"; else say "kept $scratch"; fi
}
trap cleanup EXIT

host=$(hostname -s)
cpus=$(nproc)
# Two free ports, so that two runs of this test (or a real Slurm) never meet.
read -r ctld_port slurmd_port < <(python3 -c '
import socket
ss = [socket.socket() for _ in range(2)]
for s in ss: s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in ss])')
mkdir -p "$scratch"/{state,spool,munge,log,run}
# munge: its own key and socket in the scratch directory, run as root.
dd if=/dev/urandom of="$scratch/munge/munge.key" bs=1024 count=1 status=none
chmod 0400 "$scratch/munge/munge.key"
chmod 0700 "$scratch/munge"
munged --force --key-file="$scratch/munge/munge.key" --socket="$scratch/munge/munge.socket" \
  --pid-file="$scratch/munged.pid" --log-file="$scratch/log/munged.log" --seed-file="$scratch/munge/seed"
cat > "$scratch/slurm.conf" <<EOF
ClusterName=trainrun-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$scratch/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$scratch/state
SlurmdSpoolDir=$scratch/spool
SlurmctldPidFile=$scratch/slurmctld.pid
SlurmdPidFile=$scratch/slurmd.pid
SlurmctldLogFile=$scratch/log/slurmctld.log
SlurmdLogFile=$scratch/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
MinJobAge=600
KillWait=10
SlurmdParameters=config_overrides
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF="$scratch/slurm.conf"
slurmctld -i -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
for _ in $(seq 100); do
  state=$(sinfo -h -N -o %t 2>/dev/null | head -1 || true)
  [ "$state" = idle ] && break
  [ "$state" = "down" ] || [ "$state" = "drain" ] && scontrol update nodename="$host" state=resume >/dev/null 2>&1 || true
  sleep 0.2
done
[ "$(sinfo -h -N -o %t | head -1)" = idle ] ||
  fail "the node did not come up: $(sinfo -N 2>&1); see $scratch/log"
say "slurmctld + slurmd up on $host ($cpus CPUs, SLURM_CONF=$SLURM_CONF)"

# ---- one mode ------------------------------------------------------------------------------------
job_field() { scontrol show job -o "$1" 2>/dev/null | tr ' ' '\n' | sed -n "s/^$2=//p" | head -1; }

# run_mode NAME SBATCH_SCRIPT [sbatch options...] (environment: the mode)
run_mode() {
  local name=$1 script=$2
  shift 2
  local dir="$scratch/run/$name"
  mkdir -p "$dir"
  cat > "$dir/job.yaml" <<EOF
model: {n_layer: 2, n_head: 2, n_embd: 32, vocab_size: 32, seq_len: 32}
data: {format: synthetic}
train: {global_batch_size: 8, micro_batch_size: 1, max_steps: 40, log_interval: 1, eval_interval: 0, warmup_steps: 2}
output: {dir: '$dir/out', sample_tokens: 0}
parallel: {nproc_per_node: 2, sharding: full_shard, timeout_s: 60}
checkpoint: {interval: 5}
EOF
  # This machine has no GPUs: the same script without the GPU request.
  sed '/--gpus-per-node/d' "$here/scripts/slurm/$script" > "$dir/$script"
  local id
  id=$(cd "$here" && TRAINRUN="$trainrun" OMP_NUM_THREADS=1 \
    sbatch --parsable --job-name=trn-local-test --output="$dir/slurm.out" --time=10 "$@" "$dir/$script" "$dir/job.yaml")
  say "$name: submitted job $id ($script $*)"
  # Trains?
  for _ in $(seq 600); do
    [ -f "$dir/out/metrics.jsonl" ] && [ "$(wc -l < "$dir/out/metrics.jsonl")" -ge 3 ] && break
    [ "$(job_field "$id" JobState)" = FAILED ] && fail "$name: job $id failed: $(cat "$dir/slurm.out")"
    sleep 0.1
  done
  [ "$(wc -l < "$dir/out/metrics.jsonl" 2>/dev/null || echo 0)" -ge 3 ] ||
    fail "$name: job $id did not start training: $(cat "$dir/slurm.out" 2>/dev/null)"
  say "$name: job $id trains; scancel --signal=USR1"
  scancel --signal=USR1 "$id"
  # Checkpoint -> exit 75 -> requeue -> resume -> done.
  local state="" released=""
  for _ in $(seq 1800); do
    state=$(job_field "$id" JobState)
    [ "$state" = COMPLETED ] && [ "$(job_field "$id" Restarts)" -ge 1 ] && break
    # Slurm holds a requeued job for a while (Reason=BeginTime, about two
    # minutes); a test need not wait that out, only until the node is free
    # again (an earlier start meets the old run's revoked credential).
    if [ -z "$released" ] && [ "$state" = PENDING ] && [ "$(job_field "$id" Restarts)" -ge 1 ] &&
       [ "$(sinfo -h -N -o %t | head -1)" = idle ]; then
      scontrol update jobid="$id" StartTime=now+3 >/dev/null 2>&1 && released=1 && say "$name: job $id requeued"
    fi
    case "$state" in FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY) break ;; esac
    sleep 0.1
  done
  local out
  out=$(cat "$dir/slurm.out")
  [ "$state" = COMPLETED ] || fail "$name: job $id ended $state (restarts $(job_field "$id" Restarts)):
$out"
  # The agent says it; direct workers each say "saving a checkpoint ... and exiting".
  grep -q "(checkpointed, please requeue)\|stop requested (signal 10): saving a checkpoint" <<<"$out" ||
    fail "$name: no checkpoint-on-signal in the job output:
$out"
  grep -q "requeue: trainrun saved a checkpoint; requeueing Slurm job $id" <<<"$out" ||
    fail "$name: scripts/slurm/requeue did not requeue:
$out"
  grep -q "resumed from the checkpoint of step" <<<"$out" ||
    fail "$name: the requeued run did not resume from the checkpoint:
$out"
  local steps
  steps=$(wc -l < "$dir/out/metrics.jsonl")
  [ "$steps" = 40 ] || fail "$name: metrics.jsonl has $steps records, not 40"
  say "$name: OK (USR1 -> checkpoint -> exit 75 -> requeue -> resumed -> 40/40 steps)"
}

# One agent on the node, 2 CPU workers.
TRAINRUN_SLURM_MODE=agent run_mode agent train.sbatch
# Direct workers: 2 tasks, each a worker, through the multi-node script on one node.
TRAINRUN_SLURM_MODE=direct TRAINRUN_TASKS_PER_NODE=2 run_mode direct multinode.sbatch --nodes=1
say "all modes passed"
