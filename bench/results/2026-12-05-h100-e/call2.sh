#!/usr/bin/env bash
# Call 2: pybench vs torch.multiprocessing, aside on/off; torch workers under MPS with default IO threads.
set -u
tar xJf target/gpu-pack/gpu-bundle.tar.xz -C target
here=$PWD/target/gpu-bundle
o=$OUT/x; mkdir -p $o
wheel=$(ls $here/wheels/*.whl $here/*.whl 2>/dev/null | head -1)
python3 -m pip install -q --no-index --no-deps --target /tmp/poolipc-site $wheel $(ls $here/pywheels/*.whl) > $o/pip.log 2>&1
nproc > $o/info.txt; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> $o/info.txt
for a in 1 0; do
  echo "=== pybench aside=$a start $(date +%T)" >> $o/py.txt
  POOLIPC_READY_ASIDE=$a PYTHONPATH=/tmp/poolipc-site timeout 200 python3 bench/pybench.py > $o/pybench-$a.log 2>&1
  echo "exit $? end $(date +%T)" >> $o/py.txt
done
echo "=== MPS pybench --workers 8 default IO threads $(date +%T)" >> $o/py.txt
PYTHONPATH=/tmp/poolipc-site POOLIPC_BIN=$here/poolipc timeout 130 $here/poolipc mps --accept-shared-gpu-faults -- python3 bench/pybench.py --workers 8 > $o/mps-workers.log 2>&1
echo "exit $? end $(date +%T)" >> $o/py.txt
