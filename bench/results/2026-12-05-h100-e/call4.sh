#!/usr/bin/env bash
# Call 4: pysplit plain (aside on), MPS pysplit --workers 8 (py->rust column) with spins on / off, pybench --workers 4 spins off.
set -u
[ -d target/gpu-bundle ] || tar xJf target/gpu-pack/gpu-bundle.tar.xz -C target
here=$PWD/target/gpu-bundle
o=$OUT/x; mkdir -p $o
wheel=$(ls $here/*.whl | head -1)
[ -d /tmp/poolipc-site/poolipc ] || python3 -m pip install -q --no-index --no-deps --target /tmp/poolipc-site $wheel $(ls $here/pywheels/*.whl) > $o/pip.log 2>&1
export PYTHONPATH=/tmp/poolipc-site POOLIPC_BIN=$here/poolipc
python3 --version > $o/steps.txt
step() { echo "=== $1 $(date +%T)" >> $o/steps.txt; }
M="$here/poolipc mps --accept-shared-gpu-faults --"
step "mps pysplit --workers 8"
timeout 100 $M python3 bench/pysplit.py --workers 8 --jobs 2000 > $o/mps-pysplit-workers.log 2>&1; echo "exit $?" >> $o/steps.txt
step "mps pysplit --workers 8 spins off"
POOLIPC_SPIN_US=0 POOLIPC_SPIN_IN_FLIGHT_US=0 POOLIPC_WORKER_SPIN_US=0 timeout 100 $M python3 bench/pysplit.py --workers 8 --jobs 2000 > $o/mps-pysplit-workers-nospin.log 2>&1; echo "exit $?" >> $o/steps.txt
step "plain pysplit"
timeout 100 python3 bench/pysplit.py > $o/pysplit-plain.log 2>&1; echo "exit $?" >> $o/steps.txt
step "mps pybench --workers 4 spins off"
POOLIPC_SPIN_US=0 POOLIPC_SPIN_IN_FLIGHT_US=0 POOLIPC_WORKER_SPIN_US=0 timeout 60 $M python3 bench/pybench.py --workers 4 > $o/mps-pybench-nospin.log 2>&1; echo "exit $?" >> $o/steps.txt
step "mps pybench --workers 4"
timeout 60 $M python3 bench/pybench.py --workers 4 > $o/mps-pybench.log 2>&1; echo "exit $?" >> $o/steps.txt
step end
