#!/usr/bin/env bash
# MLA and pallas after the planners' shared tile_keys; the 4x32k graph's empty programs
export OUT=${OUT:-/tmp/out}
source benchmarks/gpu_session.sh setup
LIMIT=170
run mla-tests python3 -m pytest -q -p no:cacheprovider tests/test_mla_gpu.py tests/test_mla_graph.py &
conform mla full &
conform pallas full &
wait
W=/tmp/work; mkdir -p $W
WL=decode-4x32k,decode-1x32k,decode-64x4096
b() { (( SECONDS > 250 )) && { echo "skip $1" >> $OUT/summary.txt; return; }
  local t=$SECONDS; timeout 80 "${@:2}" --backends triton --baseline none --no-check --workloads $WL --json $W/$1.json > $W/$1.log 2>&1
  echo "$1 rc $? $((SECONDS-t)) s" >> $OUT/summary.txt; }
b default python3 -m pagedkv.cli bench
b cap16 python3 probe/capped.py 16 bench
b default2 python3 -m pagedkv.cli bench
b cap16b python3 probe/capped.py 16 bench
for f in $W/*.log; do echo "== $f"; grep -E '^[a-z0-9+-]+ +triton' $f; done > $OUT/rows.txt
mkdir -p /tmp/keep; cp $OUT/*.log $OUT/*.json $OUT/*.md /tmp/keep/ 2>/dev/null; cp $W/* /tmp/keep/
tar czf /tmp/all.tgz -C /tmp/keep .
cp $OUT/summary.txt $OUT/rows.txt /tmp/; rm -rf $OUT/*; mv /tmp/all.tgz /tmp/summary.txt /tmp/rows.txt $OUT/
cat $OUT/summary.txt
