#!/usr/bin/env bash
# Call 2 (stop 39): under MPS, the bare driver's scaling (bench/floor.c, 1, 4 and 8 copies at
# once, no poolipc) beside `poolipc bench --workers 8 --mps --rounds 3` in the same call:
# whether the 6x with 8 workers that issue 24 asks is there for the driver to give.
tar xJf target/gpu-pack/gpu-bundle.tar.xz -C target; here=$PWD/target/gpu-bundle
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc
[ -x /tmp/poolipc-floor ] || nvcc -O2 -o /tmp/poolipc-floor bench/floor.c -lcuda > $OUT/floor-build.txt 2>&1 || tail -3 $OUT/floor-build.txt
for k in 1 2 4 8; do
  rm -f $OUT/floor-$k-*.txt
  timeout 90 $here/poolipc mps --accept-shared-gpu-faults -- bash -c "for i in \$(seq $k); do /tmp/poolipc-floor > '$OUT'/floor-$k-\$i.txt 2>&1 & done; wait" > /dev/null 2>&1
  cat $OUT/floor-$k-*.txt | python3 -c '
import json, sys
k = int(sys.argv[1])
us = [json.loads(l)["us_median"] for l in sys.stdin if "handoff_round_trip" in l and "\"bytes\": 4096," in l]
print(f"floor.c {k} at once: 4 KiB median per copy {min(us):.1f}-{max(us):.1f} us, together {sum(1e6 / u for u in us):.0f} handoffs/s" if len(us) == k else f"floor.c {k} at once: {len(us)} of {k} reported")
' "$k"
done
# The same with the job a lent-again job is (bench/probes/floor_scale.c: the driver calls of
# one `bench --workers` job, no export, no import, no host sync), plainly and under MPS.
nvcc -O2 -o /tmp/floor_scale bench/probes/floor_scale.c -lcuda > $OUT/floor-scale-build.txt 2>&1 || tail -3 $OUT/floor-scale-build.txt
scale() { # $1 label, $2 prefix command ("" or the MPS wrapper), $3 spin|block
  for k in 1 2 4 8; do
    rm -f $OUT/fs-*.txt; at=$(( $(date +%s%3N) + 4000 ))
    timeout 60 $2 bash -c "for i in \$(seq $k); do /tmp/floor_scale $at $3 2000 > '$OUT'/fs-\$i.txt 2>&1 & done; wait" > /dev/null 2>&1
    cat $OUT/fs-*.txt | python3 -c '
import json, sys
k, label = int(sys.argv[1]), sys.argv[2]
r = [json.loads(l)["jobs_per_s"] for l in sys.stdin if "floor_scale" in l]
print(f"floor_scale {label} {k} at once: {sum(r):.0f} jobs/s together, per copy {min(r):.0f}-{max(r):.0f}" if len(r) == k else f"floor_scale {label} {k}: {len(r)} of {k} reported")
' "$k" "$1"; cat $OUT/fs-*.txt | grep -v floor_scale | head -3
  done
}
mpsw="$here/poolipc mps --accept-shared-gpu-faults --"
scale "MPS spin" "$mpsw" spin
scale "MPS block" "$mpsw" block
scale "plain spin" "" spin
echo "== poolipc bench --workers 8 --mps --rounds 3"
RUST_LOG=warn timeout 150 $here/poolipc bench --workers 8 --mps --rounds 3 2>&1 | grep -vE " (INFO|WARN|DEBUG) " | sed -n '/under a private MPS daemon/,$p'
tar czf $OUT/floor.tgz -C $OUT $(cd $OUT && ls floor-*.txt) && rm -f $OUT/floor-*.txt
