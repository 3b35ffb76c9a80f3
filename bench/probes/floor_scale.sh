#!/usr/bin/env bash
# floor_scale.c, 1, 2, 4 and 8 copies at once (each a parent and a child), counting over the
# same 2 s window: the bare driver's jobs/s for a lent-again 4 KiB job together, and each
# copy's range. Run it inside `poolipc mps -- ...` for the MPS rows (one daemon for all).
#
#   bench/probes/floor_scale.sh BINARY LABEL [spin|block] [host|stream]
set -u
bin=$1 label=$2 wait=${3:-spin} done_on=${4:-host}
tmp=$(mktemp -d)
for k in 1 2 4 8; do
  at=$(( $(date +%s%3N) + 3000 ))
  for i in $(seq "$k"); do "$bin" "$at" "$wait" 2000 "$done_on" > "$tmp/$k-$i.txt" 2>&1 & done
  wait
  cat "$tmp/$k"-*.txt | python3 -c '
import json, sys
k, label = int(sys.argv[1]), sys.argv[2]
lines = sys.stdin.read().splitlines()
r = [json.loads(l)["jobs_per_s"] for l in lines if "floor_scale" in l]
if len(r) == k:
    print(f"  {label:<34} {k} at once: {sum(r):>8.0f} jobs/s together, per copy {min(r):.0f}-{max(r):.0f}")
else:
    print(f"  {label:<34} {k} at once: {len(r)} of {k} copies reported: " + " | ".join(l for l in lines if "floor_scale" not in l)[:300])
' "$k" "$label"
done
rm -rf "$tmp"
