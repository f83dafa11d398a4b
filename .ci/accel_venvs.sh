#!/usr/bin/env bash
# The compile tier's two extra virtual environments (outside the repo): the real TPU compiler (libtpu, through jax[tpu])
# and the real NVIDIA compiler (the CUDA 12 plugin + a pinned ptxas). Each is the project's runtime set plus pytest,
# with the CPU jax pin replaced by the accelerator's own jax; torch and the eval extras are left out (no accel test uses them).
# The project itself is not installed there: the tier runs `python -m ...` from the checkout (cwd on sys.path), so a
# kept venv never points at another clone.
# Usage: .ci/accel_venvs.sh [ROOT]   (default /work/venvs; D2F_ACCEL_VENVS overrides). Idempotent: a venv that
# already imports its backend is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
root="${1:-${D2F_ACCEL_VENVS:-/work/venvs}}"
jax_version=0.10.2
mkdir -p "$root"
# The runtime set: requirements.txt down to (not including) the evaluation block, less its jax line.
runtime="$(mktemp)"
sed -n '/^# Evaluation/q;p' requirements.txt | grep -v '^jax\[' > "$runtime"
printf '%s\n' "pytest>=8,<10" "pytest-timeout>=2.3,<3" >> "$runtime"

make_venv() {  # name, probe (python code that must run), pip requirements...
  local name="$1" probe="$2"; shift 2
  local venv="$root/$name"
  if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "$probe" >/dev/null 2>&1; then
    echo "accel venv $venv: ready"; return 0
  fi
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "$@" -r "$runtime"
  "$venv/bin/python" -c "$probe"
  echo "accel venv $venv: installed"
}

make_venv tpu "import libtpu, jax, pytest_timeout; assert jax.__version__ == '$jax_version'" "jax[tpu]==$jax_version" &
tpu_pid=$!
make_venv cuda "import jax_plugins.xla_cuda12, nvidia.cuda_nvcc, jax, pytest_timeout; assert jax.__version__ == '$jax_version'" \
  "jax==$jax_version" "jaxlib==$jax_version" "jax-cuda12-plugin==$jax_version" "jax-cuda12-pjrt==$jax_version" \
  "nvidia-cuda-nvcc-cu12" &
cuda_pid=$!
status=0
wait "$tpu_pid" || status=1
wait "$cuda_pid" || status=1
rm -f "$runtime"
exit "$status"
