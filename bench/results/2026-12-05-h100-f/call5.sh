#!/usr/bin/env bash
# Call 5: turns arbitrate between threads only (a thread moving to another worker never waits
# on its own jobs): the turns tests; turns_serial.py (one thread) with turns off and 2 ms;
# bench --workers 8 and pybench --workers 4 with the default 2 ms turns.
tar xJf target/gpu-pack/gpu-bundle.tar.xz -C target; here=$PWD/target/gpu-bundle; wheel=$(ls $here/*.whl|head -1); python3 -m pip install -q --no-index --no-deps --target /tmp/poolipc-site $wheel $(ls $here/pywheels/*.whl) > $OUT/pip.log 2>&1; export PYTHONPATH=/tmp/poolipc-site POOLIPC_BIN=$here/poolipc RUST_LOG=warn; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
mkdir -p $OUT/t; OUT=$OUT/t POOLIPC_PARTS=tests POOLIPC_TEST_BINS=turns timeout 40 $here/run.sh > $OUT/tests.log 2>&1; grep -E "FAILED|passed" $OUT/t/summary.txt
{ for w in 0 2000; do echo "== probe touch 4, turn $w us"; POOLIPC_GPU_TURN_US=$w timeout 30 python3 bench/probes/turns_serial.py --workers 4 --rounds 1; done
echo "== bench --workers 8, default turns"; timeout 40 $here/poolipc bench --workers 8
echo "== pybench --workers 4 plain, default turns"; timeout 60 python3 bench/pybench.py --workers 4; } 2>&1 | grep -v INFO | tee $OUT/turns.log
