#!/usr/bin/env bash
# Call 5: pybench --workers 4 under MPS twice more; Rust bench --workers 8 --mps (default IO threads, aside on).
set -u
[ -d target/gpu-bundle ] || tar xJf target/gpu-pack/gpu-bundle.tar.xz -C target
here=$PWD/target/gpu-bundle
o=$OUT/x; mkdir -p $o
wheel=$(ls $here/*.whl | head -1)
[ -d /tmp/poolipc-site/poolipc ] || python3 -m pip install -q --no-index --no-deps --target /tmp/poolipc-site $wheel $(ls $here/pywheels/*.whl) > $o/pip.log 2>&1
export PYTHONPATH=/tmp/poolipc-site POOLIPC_BIN=$here/poolipc
step() { echo "=== $1 $(date +%T)" >> $o/steps.txt; }
M="$here/poolipc mps --accept-shared-gpu-faults --"
for i in 1 2; do
step "mps pybench --workers 4 ($i)"
timeout 60 $M python3 bench/pybench.py --workers 4 > $o/mps-pybench-$i.log 2>&1; echo "exit $?" >> $o/steps.txt
done
step "rust bench --workers 8 --mps"
RUST_LOG=warn timeout 100 $here/poolipc bench --workers 8 --mps > $o/rust-workers.log 2>&1; echo "exit $?" >> $o/steps.txt
step end
