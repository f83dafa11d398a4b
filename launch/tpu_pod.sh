#!/usr/bin/env bash
# Run one command on every worker of a fresh Cloud TPU VM slice, collect each worker's log, delete the slice.
#
#   launch/tpu_pod.sh --name d2f-llada --zone us-east5-a --accelerator v5p-64 \
#       --config configs/llada_8b.py:tpu_v5p_64 --workdir /mnt/runs/llada \
#       -- --config.model.path=/mnt/ckpt/LLaDA-8B-Instruct --config.data.path=/mnt/data/qa.jsonl
#   launch/tpu_pod.sh --name d2f-eval --zone us-central2-b --accelerator v4-8 \
#       --command "python -m d2f_jax.evaluate --model /mnt/ckpt/llada --task gsm8k --limit 50"
#   add --dry-run to print every command instead of running it.
#
# Steps: gcloud create -> copy this checkout (or clone --git) to all workers and pip-install it with
# jax[tpu] -> run the command on all workers at once (--worker=all; jax.distributed finds its peers on a
# TPU VM by itself) with output tee'd to ~/d2f_logs/<host>.log -> copy the logs to --logs -> delete the
# slice (also after a failure or Ctrl-C, unless --keep). Multi-host runs need a --workdir every worker sees
# (a gcsfuse-mounted bucket, Filestore/NFS); a local path gives each worker its own checkpoints.
set -euo pipefail

PROG="tpu_pod.sh"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() {
  cat <<EOF
usage: launch/$PROG --name NAME --zone ZONE --accelerator TYPE
                    (--config CONFIG --workdir DIR [-- DISTILL_FLAGS...] | --command "CMD")
                    [--project P] [--version RUNTIME] [--spot] [--src DIR | --git URL [--ref REF]]
                    [--logs DIR] [--keep] [--dry-run]

  --name NAME          TPU VM name (lowercase letters, digits, '-'; starts with a letter)
  --zone ZONE          e.g. us-east5-a (v5p), us-west4-a (v5e), us-central2-b (v4)
  --accelerator TYPE   v4-N, v5p-N, v5e-N (= v5litepod-N) or v6e-N, e.g. v5p-64
  --config CONFIG      run 'python -m d2f_jax.distill --config CONFIG --workdir DIR' plus the flags after --
  --workdir DIR        distillation workdir (shared by all workers for multi-host slices)
  --command "CMD"      run this shell command instead (in the repo checkout, venv active)
  --project P          GCP project (default: gcloud's configured one)
  --version RUNTIME    TPU software version (default per generation, e.g. v2-alpha-tpuv5 for v5p)
  --spot               create a Spot slice
  --src DIR            copy this source tree to the workers (default: this checkout, $ROOT)
  --git URL            pip install "d2f_jax[tpu,eval] @ git+URL@REF" on the workers instead of copying
                       (--ref: branch, tag or commit, default main; packaged configs: configs/<name>.py)
  --logs DIR           where the worker logs land (default: logs/NAME)
  --keep               do not delete the slice at the end
  --retries N          rerun a job that exits 143 (preempted after saving its checkpoint; distill resumes from
                       --workdir, which must outlive the slice, e.g. gs://) up to N times (default 3)
  --dry-run            print every command instead of running it
EOF
}

# shellcheck source=launch/common.sh
source "$ROOT/launch/common.sh"

NAME="" ZONE="" ACCEL="" PROJECT="" VERSION="" SPOT=0 SRC="" GIT="" REF="main" CONFIG="" WORKDIR="" RETRIES=3
COMMAND="" LOGS="" KEEP=0 DRY_RUN=0
EXTRA=()
declare -A VALUE_FLAGS=([--name]=NAME [--zone]=ZONE [--accelerator]=ACCEL [--accelerator-type]=ACCEL \
  [--project]=PROJECT [--version]=VERSION [--src]=SRC [--git]=GIT [--ref]=REF [--retries]=RETRIES [--config]=CONFIG \
  [--workdir]=WORKDIR [--command]=COMMAND [--logs]=LOGS)
declare -A SWITCHES=([--spot]=SPOT [--keep]=KEEP [--dry-run]=DRY_RUN [--dry_run]=DRY_RUN)
parse_flags "$@"

# --- validation -------------------------------------------------------------------------------------
[[ -n "$NAME" ]] || die "--name is required"
[[ -n "$ZONE" ]] || die "--zone is required"
[[ -n "$ACCEL" ]] || die "--accelerator is required (e.g. v5p-64)"
[[ "$NAME" =~ ^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$ ]] \
  || die "--name '$NAME' is not a valid TPU name (lowercase letters, digits and '-', starting with a letter)"
[[ "$ZONE" =~ ^[a-z]+-[a-z]+[0-9]+-[a-z]$ ]] || die "--zone '$ZONE' does not look like a zone (e.g. us-east5-a)"
if [[ "$ACCEL" =~ ^v5e-([0-9]+)$ ]]; then
  ACCEL="v5litepod-${BASH_REMATCH[1]}"  # gcloud's name for v5e
fi
[[ "$ACCEL" =~ ^(v4|v5p|v5litepod|v6e)-([0-9]+)$ ]] \
  || die "--accelerator '$ACCEL' is not a TPU type (v4-N, v5p-N, v5e-N / v5litepod-N, v6e-N)"
GEN="${BASH_REMATCH[1]}"
SIZE="${BASH_REMATCH[2]}"
case "$GEN" in
  v4|v5p)
    (( SIZE >= 8 && (SIZE & (SIZE - 1)) == 0 )) || die "--accelerator $ACCEL: $GEN sizes are powers of two >= 8"
    HOSTS=$(( SIZE / 8 )); DEFAULT_VERSION=$([[ $GEN == v4 ]] && echo tpu-ubuntu2204-base || echo v2-alpha-tpuv5) ;;
  v5litepod|v6e)
    (( SIZE >= 1 && SIZE <= 256 && (SIZE & (SIZE - 1)) == 0 && SIZE != 2 )) \
      || die "--accelerator $ACCEL: $GEN sizes are 1, 4, 8, 16, 32, 64, 128 or 256"
    HOSTS=$(( SIZE <= 8 ? 1 : SIZE / 4 ))
    DEFAULT_VERSION=$([[ $GEN == v6e ]] && echo v2-alpha-tpuv6e || echo v2-alpha-tpuv5-lite) ;;
esac
(( HOSTS >= 1 )) || HOSTS=1
VERSION="${VERSION:-$DEFAULT_VERSION}"

if [[ -n "$CONFIG" && -n "$COMMAND" ]]; then
  die "give either --config (distillation) or --command, not both"
fi
[[ -n "$CONFIG" || -n "$COMMAND" ]] || die "nothing to run: give --config CONFIG --workdir DIR, or --command \"CMD\""
if [[ -n "$CONFIG" ]]; then
  [[ -n "$WORKDIR" ]] || die "--config needs --workdir (a directory every worker sees, for multi-host slices)"
else
  [[ -z "$WORKDIR" ]] || die "--workdir goes with --config; put it inside --command instead"
  [[ ${#EXTRA[@]} -eq 0 ]] || die "flags after -- go to the distillation (--config); put them inside --command"
fi
check_retries "$RETRIES"
[[ -z "$SRC" || -z "$GIT" ]] || die "give either --src or --git, not both"
if [[ -z "$GIT" ]]; then
  SRC="${SRC:-$ROOT}"
  [[ -d "$SRC" ]] || die "--src '$SRC' is not a directory"
  [[ -f "$SRC/pyproject.toml" && -d "$SRC/d2f_jax" ]] || die "--src '$SRC' is not a d2f_jax checkout (no pyproject.toml / d2f_jax/)"
  if [[ -n "$CONFIG" ]]; then
    CONFIG_FILE="${CONFIG%%:*}"
    [[ -f "$SRC/$CONFIG_FILE" ]] || die "--config file '$CONFIG_FILE' not found in $SRC (give it relative to the repo root)"
  fi
fi
LOGS="${LOGS:-logs/$NAME}"
if [[ $DRY_RUN -eq 0 ]]; then
  command -v gcloud >/dev/null 2>&1 || die "gcloud is not installed or not on PATH (https://cloud.google.com/sdk); try --dry-run"
fi

# --- commands ------------------------------------------------------------------------------------------

GC=(gcloud compute tpus tpu-vm)
WHERE=(--zone="$ZONE")
[[ -n "$PROJECT" ]] && WHERE+=(--project="$PROJECT")

quote_all() { local out="" a; for a in "$@"; do out+="$(printf '%q' "$a") "; done; echo "${out% }"; }

# Workers: a venv with the package and its TPU + evaluation extras (jax[tpu], the sandbox, lm-eval; not the
# tests' torch), installed the way a user installs it: from the git URL, or from the copied tree.
SETUP='set -e; python3 -m venv ~/d2f_venv; . ~/d2f_venv/bin/activate; pip install -q -U pip;'
if [[ -n "$GIT" ]]; then
  SETUP+=" pip install -q $(printf '%q' "d2f_jax[tpu,eval] @ git+$GIT@$REF")"
else
  SETUP+=' pip install -q ~/d2f_jax"[tpu,eval]"'
fi
if [[ -n "$CONFIG" ]]; then
  JOB="python -m d2f_jax.distill $(quote_all --config="$CONFIG" --workdir="$WORKDIR" ${EXTRA[@]+"${EXTRA[@]}"})"
else
  JOB="$COMMAND"
fi
REMOTE_RUN="cd ~/d2f_jax && . ~/d2f_venv/bin/activate && mkdir -p ~/d2f_logs && { $JOB ; } 2>&1 | tee ~/d2f_logs/\$(hostname).log; exit \${PIPESTATUS[0]}"

CREATED=0 RAN=0
finish() {
  local status=$?
  trap - EXIT INT TERM
  if [[ $RAN -eq 1 ]]; then
    echo "$PROG: collecting logs from $HOSTS worker(s) into $LOGS" >&2
    for (( i = 0; i < HOSTS; i++ )); do
      run mkdir -p "$LOGS/worker-$i" || true
      run "${GC[@]}" scp "$NAME:~/d2f_logs/*" "$LOGS/worker-$i/" "${WHERE[@]}" --worker="$i" || true
    done
  fi
  if [[ $CREATED -eq 1 ]]; then  # also after a failed create: it may have left a half-made slice
    if [[ $KEEP -eq 1 ]]; then
      echo "$PROG: --keep: slice $NAME stays up; delete it with: ${GC[*]} delete $NAME ${WHERE[*]} --quiet" >&2
    else
      run "${GC[@]}" delete "$NAME" "${WHERE[@]}" --quiet || status=$(( status ? status : 1 ))
    fi
  fi
  exit "$status"
}
trap finish EXIT
trap 'exit 130' INT TERM

CREATE=("${GC[@]}" create "$NAME" "${WHERE[@]}" --accelerator-type="$ACCEL" --version="$VERSION")
[[ $SPOT -eq 1 ]] && CREATE+=(--spot)
CREATED=1
run "${CREATE[@]}"

if [[ -n "$GIT" ]]; then
  run "${GC[@]}" ssh "$NAME" "${WHERE[@]}" --worker=all \
    --command="rm -rf ~/d2f_jax && mkdir -p ~/d2f_jax && $SETUP"
else
  TARBALL="${TMPDIR:-/tmp}/d2f_jax-$NAME.tgz"
  run tar -czf "$TARBALL" --exclude=".venv*" --exclude=.git --exclude=__pycache__ --exclude=logs --exclude=results \
    -C "$SRC" .
  run "${GC[@]}" scp "$TARBALL" "$NAME:~/d2f_jax.tgz" "${WHERE[@]}" --worker=all
  run "${GC[@]}" ssh "$NAME" "${WHERE[@]}" --worker=all \
    --command="rm -rf ~/d2f_jax && mkdir -p ~/d2f_jax && tar -xzf ~/d2f_jax.tgz -C ~/d2f_jax && $SETUP"
fi

RAN=1
attempt=0
while :; do  # a job that exits 143 (preempted after its checkpoint: distill resumes) runs again on the slice
  status=0
  run "${GC[@]}" ssh "$NAME" "${WHERE[@]}" --worker=all --command="$REMOTE_RUN" || status=$?
  if should_retry "$status" "$attempt" "$RETRIES"; then
    attempt=$(( attempt + 1 ))
    continue
  fi
  break
done
[[ $status -eq 0 ]] || exit "$status"
