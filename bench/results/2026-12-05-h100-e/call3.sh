#!/usr/bin/env bash
# Call 3: Rust bench plain (floor, torch.mp), pybench (written column), MPS: pybench --workers 8 (windows), pysplit, pysplit --workers.
set -u
[ -d target/gpu-bundle ] || tar xJf target/gpu-pack/gpu-bundle.tar.xz -C target
here=$PWD/target/gpu-bundle
o=$OUT/x; mkdir -p $o
wheel=$(ls $here/*.whl | head -1)
[ -d /tmp/poolipc-site/poolipc ] || python3 -m pip install -q --no-index --no-deps --target /tmp/poolipc-site $wheel $(ls $here/pywheels/*.whl) > $o/pip.log 2>&1
[ -x /tmp/poolipc-floor ] || nvcc -O2 -o /tmp/poolipc-floor bench/floor.c -lcuda > $o/floor.log 2>&1
export PYTHONPATH=/tmp/poolipc-site POOLIPC_BIN=$here/poolipc
step() { echo "=== $1 $(date +%T)" >> $o/steps.txt; }
step "rust bench plain"
RUST_LOG=warn timeout 200 $here/poolipc bench --floor /tmp/poolipc-floor --torchmp bench/torchmp.py --copy-max-mib 64 --result-max-mib 64 > $o/bench.log 2>&1; echo "exit $?" >> $o/steps.txt
step "pybench plain"
timeout 120 python3 bench/pybench.py > $o/pybench.log 2>&1; echo "exit $?" >> $o/steps.txt
M="$here/poolipc mps --accept-shared-gpu-faults --"
step "mps pybench --workers 8"
timeout 100 $M python3 bench/pybench.py --workers 8 > $o/mps-workers.log 2>&1; echo "exit $?" >> $o/steps.txt
step "mps pysplit --workers 8"
timeout 80 $M python3 bench/pysplit.py --workers 8 --jobs 2000 > $o/mps-pysplit-workers.log 2>&1; echo "exit $?" >> $o/steps.txt
step "mps pysplit"
timeout 110 $M python3 bench/pysplit.py --probe $o/probe > $o/mps-pysplit.log 2>&1; echo "exit $?" >> $o/steps.txt; rm -rf $o/probe
step end
