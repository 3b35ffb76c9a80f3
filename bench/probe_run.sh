#!/usr/bin/env bash
# Where the 4 KiB round trip's time goes, plainly and under a private MPS daemon: runs
# `poolipc bench` (small sizes only) with POOLIPC_PROBE, then bench/probe_report.py on the
# marks, beside floor.c in the same run. Usage: bench/probe_run.sh POOLIPC_BINARY OUTDIR
set -u
bin=$1; out=$2; repo=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
nvcc -O2 -o /tmp/poolipc-floor "$repo/bench/floor.c" -lcuda > "$out/floor-build.txt" 2>&1 || echo "floor did not build"
small="--max-mib 1 --copy-max-mib 1 --result-max-mib 1 --floor /tmp/poolipc-floor"
for round in $(seq 1 "${ROUNDS:-2}"); do
  echo "=== round $round: plain, probe off"; RUST_LOG=warn "$bin" bench $small 2>&1 | sed -n '/against the peers/,/split/p'
  echo "=== round $round: MPS, probe off"; "$bin" mps --accept-shared-gpu-faults -- env RUST_LOG=warn "$bin" bench $small 2>&1 | sed -n '/against the peers/,/split/p'
  rm -rf "$out/mps-$round"; mkdir -p "$out/mps-$round"
  echo "=== round $round: MPS, probe on"; "$bin" mps --accept-shared-gpu-faults -- env RUST_LOG=warn POOLIPC_PROBE="$out/mps-$round" "$bin" bench $small 2>&1 | sed -n '/against the peers/,/split/p'
  python3 "$repo/bench/probe_report.py" "$out/mps-$round" --skip 1 --count 400 --title "MPS round $round, 4 KiB recycled"
  python3 "$repo/bench/probe_report.py" "$out/mps-$round" --skip 402 --count 400 --title "MPS round $round, 4 KiB re-lend"
done
rm -rf "$out/plain"; mkdir -p "$out/plain"
echo "=== plain, probe on"; RUST_LOG=warn POOLIPC_PROBE="$out/plain" "$bin" bench $small 2>&1 | sed -n '/against the peers/,/split/p'
python3 "$repo/bench/probe_report.py" "$out/plain" --skip 1 --count 400 --title "plain, 4 KiB recycled"
