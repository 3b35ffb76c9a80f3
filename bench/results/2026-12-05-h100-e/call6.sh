#!/usr/bin/env bash
# Call 6: under MPS, bench --workers 8 with 4 and 8 IO threads alternated; pybench --workers 4 with 1.5 s windows.
set -u
[ -d target/gpu-bundle ] || tar xJf target/gpu-pack/gpu-bundle.tar.xz -C target
here=$PWD/target/gpu-bundle
o=$OUT/x; mkdir -p $o
wheel=$(ls $here/*.whl | head -1)
[ -d /tmp/poolipc-site/poolipc ] || python3 -m pip install -q --no-index --no-deps --target /tmp/poolipc-site $wheel $(ls $here/pywheels/*.whl) > $o/pip.log 2>&1
export PYTHONPATH=/tmp/poolipc-site POOLIPC_BIN=$here/poolipc
step() { echo "=== $1 $(date +%T)" >> $o/steps.txt; }
M="$here/poolipc mps --accept-shared-gpu-faults --"
step "mps bench --workers 8 --io-threads 4,8,4,8"
RUST_LOG=warn timeout 130 $M $here/poolipc bench --workers 8 --io-threads 4,8,4,8 > $o/rust-io.log 2>&1; echo "exit $?" >> $o/steps.txt
step "mps pybench --workers 4, 1.5 s windows"
POOLIPC_BENCH_WINDOW_MS=1500 timeout 90 $M python3 bench/pybench.py --workers 4 > $o/mps-pybench-long.log 2>&1; echo "exit $?" >> $o/steps.txt
step end
