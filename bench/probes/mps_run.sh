#!/usr/bin/env bash
# Probe driver for mps_probe.py: plain, then under a private MPS daemon; and the daemon's quit.
set -u
here=$(cd "$(dirname "$0")" && pwd)
export CU_PY_DIR=$here

echo "== plain"; timeout 120 python3 "$here/mps_probe.py"
echo "== mps"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/pmps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/pmps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
which nvidia-cuda-mps-control nvidia-cuda-mps-server; ls -la /tmp/nvidia-mps 2>&1 | head -3
nvidia-cuda-mps-control -d; echo "daemon rc $?"; ls -la $CUDA_MPS_PIPE_DIRECTORY
t=$(date +%s%N); echo "start_server -uid $(id -u)" | nvidia-cuda-mps-control; echo "start_server rc $? $(( ($(date +%s%N)-t)/1000000 )) ms"
echo get_server_list | nvidia-cuda-mps-control; echo "list rc $?"
timeout 120 python3 "$here/mps_probe.py"
echo get_server_list | nvidia-cuda-mps-control
echo "== quit while a client lives"
python3 -c "import sys; sys.path.insert(0, '$CU_PY_DIR'); import cu, time; cu.init_ctx(); print('client up', flush=True); time.sleep(6); print('client exits', flush=True)" &
sleep 3; t=$(date +%s%N); echo quit | timeout 20 nvidia-cuda-mps-control; echo "quit rc $? after $(( ($(date +%s%N)-t)/1000000 )) ms"
wait; sleep 1; pgrep -a nvidia-cuda-mps || echo "no mps processes left"
tail -20 $CUDA_MPS_LOG_DIRECTORY/control.log
