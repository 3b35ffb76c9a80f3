#!/usr/bin/env bash
# Call 1 (stop 39): what stop 38 left for the GPU. The turns tests (wait_any among them) on
# CUDA; the gputurns part (turns_serial.py, pybench --workers 4 and bench --workers 8 with
# turns off and on; pybench's one-thread rows now beside wait_any); the mpsspin part; and
# pybench --workers 4 under MPS (threads, one thread oldest-first, one thread wait_any).
tar xJf target/gpu-pack/gpu-bundle.tar.xz -C target; here=$PWD/target/gpu-bundle
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
mkdir -p $OUT/x; OUT=$OUT/x POOLIPC_PARTS=tests,gputurns,mpsspin POOLIPC_TEST_BINS=turns timeout 420 $here/run.sh > $OUT/run.log 2>&1; echo "run.sh exit $?"
tail -120 $OUT/x/summary.txt
wheel=$(ls $here/*.whl|head -1); [ -d /tmp/poolipc-site/poolipc ] || python3 -m pip install -q --no-index --no-deps --target /tmp/poolipc-site $wheel $(ls $here/pywheels/*.whl) > $OUT/pip.log 2>&1
echo "== pybench --workers 4 under MPS"
PYTHONPATH=/tmp/poolipc-site POOLIPC_BIN=$here/poolipc RUST_LOG=warn timeout 130 $here/poolipc mps --accept-shared-gpu-faults -- python3 bench/pybench.py --workers 4 2>&1 | grep -vE ' INFO |installed a shareable' | tail -24 | tee $OUT/pybench-mps.log
cd $OUT && tar czf x.tgz x && rm -rf x
