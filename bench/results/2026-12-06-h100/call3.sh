#!/usr/bin/env bash
# Call 3 (stop 39): floor_scale.c with the parent querying DONE on the host (no stream wait in
# the parent, as poolipc's parent), 1, 2, 4 and 8 copies at once, under MPS and plainly.
tar xJf target/gpu-pack/gpu-bundle.tar.xz -C target; here=$PWD/target/gpu-bundle
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
nvcc -O2 -o /tmp/floor_scale_h bench/probes/floor_scale.c -lcuda > $OUT/build.txt 2>&1 || tail -3 $OUT/build.txt
scale() { # $1 label, $2 prefix command, $3 spin|block, $4 stream|host
  for k in 1 2 4 8; do
    rm -f $OUT/fs-*.txt; at=$(( $(date +%s%3N) + 4000 ))
    timeout 60 $2 bash -c "for i in \$(seq $k); do /tmp/floor_scale_h $at $3 2000 $4 > '$OUT'/fs-\$i.txt 2>&1 & done; wait" > /dev/null 2>&1
    cat $OUT/fs-*.txt | python3 -c '
import json, sys
k, label = int(sys.argv[1]), sys.argv[2]
r = [json.loads(l)["jobs_per_s"] for l in sys.stdin if "floor_scale" in l]
print(f"floor_scale {label} {k} at once: {sum(r):.0f} jobs/s together, per copy {min(r):.0f}-{max(r):.0f}" if len(r) == k else f"floor_scale {label} {k}: {len(r)} of {k} reported")
' "$k" "$1"; cat $OUT/fs-*.txt | grep -v floor_scale | head -3
  done
  rm -f $OUT/fs-*.txt
}
mpsw="$here/poolipc mps --accept-shared-gpu-faults --"
scale "MPS spin, DONE on the host" "$mpsw" spin host
scale "plain spin, DONE on the host" "" spin host
scale "MPS spin, DONE on the stream" "$mpsw" spin stream
