#!/usr/bin/env bash
# Call 4 (stop 39): the bundle's new `floorscale` part (the bare driver's scaling beside
# poolipc's, under MPS and plainly).
tar xJf target/gpu-pack/gpu-bundle.tar.xz -C target
mkdir -p $OUT/x; OUT=$OUT/x POOLIPC_PARTS=floorscale timeout 280 target/gpu-bundle/run.sh > $OUT/run.log 2>&1; echo "run.sh exit $?"
cat $OUT/x/summary.txt; cd $OUT && tar czf x.tgz x && rm -rf x
