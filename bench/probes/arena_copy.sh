#!/usr/bin/env bash
# arena_copy.c built, run plainly, then under a private MPS daemon (its own pipe and log
# directories; nothing system-wide changes). Usage: bench/probes/arena_copy.sh [REPS]
set -u
here=$(cd "$(dirname "$0")" && pwd)
bin=/tmp/poolipc-arena-copy
nvcc -O2 -o "$bin" "$here/arena_copy.c" -lcuda || exit 1
echo "== plain"; timeout 240 "$bin" "${1:-1000}"; echo "exit $?"
command -v nvidia-cuda-mps-control >/dev/null || { echo "== mps: no nvidia-cuda-mps-control"; exit 0; }
export CUDA_MPS_PIPE_DIRECTORY=/tmp/acmps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/acmps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d || { echo "== mps: the daemon did not start"; exit 0; }
echo "== mps"; timeout 240 "$bin" "${1:-1000}"; echo "exit $?"
echo quit | timeout 20 nvidia-cuda-mps-control
