#!/usr/bin/env bash
# Set up a venv with jax[cuda12] on a GPU host and run a distillation or evaluation; one host or several.
#
#   launch/gpu_host.sh --config configs/llada_8b.py:gpu_8xh100 --workdir /data/runs/llada \
#       -- --config.model.path=/data/ckpt/LLaDA-8B-Instruct --config.data.path=/data/qa.jsonl
#   launch/gpu_host.sh --eval -- --model /data/ckpt/llada --lora_dir /data/runs/llada/adapter --task gsm8k
#   two hosts, run on each (host_index 0 and 1), workdir on a shared filesystem:
#   launch/gpu_host.sh --config configs/llada_8b.py:gpu_2x8xh100 --workdir /nfs/runs/llada \
#       --num_hosts 2 --host_index 0 --coordinator 10.0.0.1:12355
#   add --dry-run to print every command instead of running it.
#
# Steps: python3 -m venv -> pip install -e ".[cuda12,eval]" (this checkout with jax[cuda12]; not the tests'
# torch) -> run the command with its output tee'd to --logs/host-<index>.log. With --num_hosts > 1
# the command runs under launch/jax_distributed.py, which starts jax.distributed from
# JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID (also exported for --command).
set -euo pipefail

PROG="gpu_host.sh"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() {
  cat <<EOF
usage: launch/$PROG (--config CONFIG --workdir DIR | --eval | --command "CMD") [-- FLAGS...]
                    [--venv DIR] [--cuda 12|13] [--gpus 0,1,...] [--skip_install] [--logs DIR]
                    [--num_hosts N --host_index I --coordinator HOST:PORT] [--dry-run]

  --config CONFIG      run 'python -m d2f_jax.distill --config CONFIG --workdir DIR' plus the flags after --
  --workdir DIR        distillation workdir (on a filesystem every host sees when --num_hosts > 1)
  --eval               run 'python -m d2f_jax.evaluate' with the flags after --
  --command "CMD"      run this shell command instead (venv active, in the repo root)
  --venv DIR           virtual environment to create / reuse (default: ~/d2f_venv)
  --cuda 12|13         CUDA major version of the jax wheel (default 12: jax[cuda12])
  --gpus LIST          CUDA_VISIBLE_DEVICES for this run, e.g. 0,1,2,3 (default: all)
  --skip_install       use the venv as it is
  --logs DIR           where the log goes (default: logs/gpu)
  --num_hosts N        hosts in the job (default 1); with N > 1 also --host_index and --coordinator
  --host_index I       this host's index, 0 .. N-1 (0 runs the coordinator)
  --coordinator H:P    address of host 0, reachable from every host
  --retries N          rerun a job that exits 143 (preempted after saving its checkpoint: distill resumes from
                       --workdir) up to N times (default 3; 0: never)
  --dry-run            print every command instead of running it

Exit status: the job's own (distill: 0 done, 2 bad config, 3 non-finite loss, 143 preempted); 2 for bad
arguments here.
EOF
}

# shellcheck source=launch/common.sh
source "$ROOT/launch/common.sh"

CONFIG="" WORKDIR="" EVAL=0 COMMAND="" VENV="" CUDA="12" GPUS="" SKIP_INSTALL=0 LOGS="logs/gpu"
NUM_HOSTS=1 HOST_INDEX="" COORDINATOR="" DRY_RUN=0 RETRIES=3
EXTRA=()
declare -A VALUE_FLAGS=([--config]=CONFIG [--workdir]=WORKDIR [--command]=COMMAND [--venv]=VENV [--cuda]=CUDA \
  [--gpus]=GPUS [--logs]=LOGS [--num_hosts]=NUM_HOSTS [--num-hosts]=NUM_HOSTS [--host_index]=HOST_INDEX \
  [--host-index]=HOST_INDEX [--coordinator]=COORDINATOR [--retries]=RETRIES)
declare -A SWITCHES=([--eval]=EVAL [--skip_install]=SKIP_INSTALL [--skip-install]=SKIP_INSTALL [--dry-run]=DRY_RUN \
  [--dry_run]=DRY_RUN)
parse_flags "$@"

# --- validation -------------------------------------------------------------------------------------
modes=$(( (${#CONFIG} > 0) + EVAL + (${#COMMAND} > 0) ))
[[ $modes -eq 1 ]] || die "give exactly one of --config CONFIG --workdir DIR, --eval, --command \"CMD\""
if [[ -n "$CONFIG" ]]; then
  [[ -n "$WORKDIR" ]] || die "--config needs --workdir"
  CONFIG_FILE="${CONFIG%%:*}"
  if [[ -f "$CONFIG_FILE" && "$CONFIG_FILE" != /* && ! -f "$ROOT/$CONFIG_FILE" ]]; then
    CONFIG="$PWD/$CONFIG"  # relative to here; the job runs in the repo root
  fi
  [[ -f "$ROOT/$CONFIG_FILE" || -f "$CONFIG_FILE" ]] || die "--config file '$CONFIG_FILE' not found"
  [[ "$WORKDIR" == /* ]] || WORKDIR="$PWD/$WORKDIR"
else
  [[ -z "$WORKDIR" ]] || die "--workdir goes with --config"
fi
if [[ -n "$COMMAND" && ${#EXTRA[@]} -gt 0 ]]; then
  die "flags after -- go to distill / evaluate; put them inside --command"
fi
if [[ $EVAL -eq 1 && ${#EXTRA[@]} -eq 0 ]]; then
  die "--eval needs the evaluation flags after --, e.g. -- --model DIR --task gsm8k"
fi
[[ "$CUDA" =~ ^(12|13)$ ]] || die "--cuda must be 12 or 13, got '$CUDA'"
[[ -z "$GPUS" || "$GPUS" =~ ^[0-9]+(,[0-9]+)*$ ]] || die "--gpus must be a comma-separated list of GPU indices, got '$GPUS'"
check_retries "$RETRIES"
[[ "$NUM_HOSTS" =~ ^[1-9][0-9]*$ ]] || die "--num_hosts must be a positive integer, got '$NUM_HOSTS'"
if (( NUM_HOSTS > 1 )); then
  [[ -n "$HOST_INDEX" ]] || die "--num_hosts $NUM_HOSTS needs --host_index (0 .. $(( NUM_HOSTS - 1 )))"
  [[ "$HOST_INDEX" =~ ^[0-9]+$ ]] && (( HOST_INDEX < NUM_HOSTS )) \
    || die "--host_index must be in 0 .. $(( NUM_HOSTS - 1 )), got '$HOST_INDEX'"
  [[ -n "$COORDINATOR" ]] || die "--num_hosts $NUM_HOSTS needs --coordinator HOST:PORT (host 0's address)"
  [[ "$COORDINATOR" =~ ^[A-Za-z0-9._-]+:[0-9]{1,5}$ ]] || die "--coordinator must be HOST:PORT, got '$COORDINATOR'"
else
  [[ -z "$HOST_INDEX" && -z "$COORDINATOR" ]] || die "--host_index / --coordinator need --num_hosts > 1"
  HOST_INDEX=0
fi
VENV="${VENV:-$HOME/d2f_venv}"
[[ "$VENV" == /* ]] || VENV="$PWD/$VENV"
[[ "$LOGS" == /* ]] || LOGS="$PWD/$LOGS"
if [[ $DRY_RUN -eq 0 ]]; then
  command -v python3 >/dev/null 2>&1 || die "python3 is not on PATH"
  command -v nvidia-smi >/dev/null 2>&1 || die "no NVIDIA driver here (nvidia-smi not found); try --dry-run"
fi

# --- commands ------------------------------------------------------------------------------------------
setenv() {  # export NAME=VALUE, printed in a dry run
  if [[ $DRY_RUN -eq 1 ]]; then
    printf '+ export %s=%q\n' "$1" "$2"
  else
    export "$1=$2"
  fi
}

PY="$VENV/bin/python"
if [[ $SKIP_INSTALL -eq 0 ]]; then
  run python3 -m venv "$VENV"
  run "$PY" -m pip install -q -U pip
  # The package with its CUDA and evaluation extras (jax[cudaN], the sandbox, lm-eval; not the tests' torch),
  # editable: this checkout is the code that runs.
  run "$PY" -m pip install -q -e "$ROOT[cuda$CUDA,eval]"
  run "$PY" -c "import jax; print(jax.devices())"
fi

[[ -n "$GPUS" ]] && setenv CUDA_VISIBLE_DEVICES "$GPUS"
setenv XLA_PYTHON_CLIENT_MEM_FRACTION "0.95"  # the default 0.75 leaves a fifth of each GPU unused
LAUNCH=("$PY")
if (( NUM_HOSTS > 1 )); then
  setenv JAX_COORDINATOR_ADDRESS "$COORDINATOR"
  setenv JAX_NUM_PROCESSES "$NUM_HOSTS"
  setenv JAX_PROCESS_ID "$HOST_INDEX"
  LAUNCH+=("$ROOT/launch/jax_distributed.py")
fi
if [[ -n "$CONFIG" ]]; then
  JOB=("${LAUNCH[@]}" -m d2f_jax.distill --config="$CONFIG" --workdir="$WORKDIR" ${EXTRA[@]+"${EXTRA[@]}"})
elif [[ $EVAL -eq 1 ]]; then
  JOB=("${LAUNCH[@]}" -m d2f_jax.evaluate "${EXTRA[@]}")
else
  setenv VIRTUAL_ENV "$VENV"
  setenv PATH "$VENV/bin:$PATH"
  JOB=(bash -c "$COMMAND")
fi

LOG="$LOGS/host-$HOST_INDEX.log"
run mkdir -p "$LOGS"
run cd "$ROOT"
if [[ $DRY_RUN -eq 1 ]]; then
  printf '+'; printf ' %q' "${JOB[@]}"; printf ' 2>&1 | tee %q\n' "$LOG"
  exit 0
fi
cd "$ROOT"
# The job runs in the background so a SIGTERM to this script reaches it (it saves and exits 143) and is not
# mistaken for the job's own preemption: a job that exits 143 is rerun (it resumes), a stopped script is not.
STOPPING=0 CHILD=""
on_signal() { STOPPING=1; [[ -z "$CHILD" ]] || kill -TERM "$CHILD" 2>/dev/null || true; }
trap on_signal TERM INT
attempt=0
: > "$LOG"
while :; do
  { printf '+'; printf ' %q' "${JOB[@]}"; printf ' 2>&1 | tee -a %q\n' "$LOG"; } >&2
  "${JOB[@]}" > >(tee -a "$LOG") 2>&1 &
  CHILD=$!
  status=0; wait "$CHILD" || status=$?
  while kill -0 "$CHILD" 2>/dev/null; do status=0; wait "$CHILD" || status=$?; done  # a trapped signal ends wait early
  CHILD=""
  if [[ $STOPPING -eq 0 ]] && should_retry "$status" "$attempt" "$RETRIES"; then
    attempt=$(( attempt + 1 ))
    continue
  fi
  break
done
echo "$PROG: exit status $status; log in $LOG" >&2
exit "$status"
