#!/usr/bin/env bash
# Call 4: GPU turns of a length (gpu_turn): the turns tests; turns_serial.py with 4 workers,
# turns off and 2 ms; bench --workers 8 with turns off, 2 ms, 5 ms; pybench --workers 4 off and 2 ms.
tar xJf target/gpu-pack/gpu-bundle.tar.xz -C target; here=$PWD/target/gpu-bundle; wheel=$(ls $here/*.whl|head -1); python3 -m pip install -q --no-index --no-deps --target /tmp/poolipc-site $wheel $(ls $here/pywheels/*.whl) > $OUT/pip.log 2>&1; export PYTHONPATH=/tmp/poolipc-site POOLIPC_BIN=$here/poolipc RUST_LOG=warn; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
mkdir -p $OUT/t; OUT=$OUT/t POOLIPC_PARTS=tests POOLIPC_TEST_BINS=turns timeout 60 $here/run.sh > $OUT/tests.log 2>&1; grep -E "turns::|FAILED|passed" $OUT/t/summary.txt
{ for w in 0 2000; do echo "== probe touch 4, turn $w us"; POOLIPC_GPU_TURN_US=$w timeout 40 python3 bench/probes/turns_serial.py --workers 4 --rounds 1; done
for w in 0 2000 5000; do echo "== bench --workers 8 turn $w us"; POOLIPC_GPU_TURN_US=$w timeout 50 $here/poolipc bench --workers 8; done
for w in 0 2000; do echo "== pybench --workers 4 plain, turn $w us"; POOLIPC_GPU_TURN_US=$w timeout 70 python3 bench/pybench.py --workers 4; done; } 2>&1 | grep -v INFO | tee $OUT/turns.log
