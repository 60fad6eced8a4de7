#!/bin/bash
# `radixserve bench`, one tree, two sets of server arguments side by side: for each round and workload, both
# back to back, the order swapped every round. Usage: benchmarks/ab_args.sh "ARGS_A" "ARGS_B" [ROUNDS] [WORKLOADS]
# > walls.tsv (e.g. "--kv-cache-dtype float32" "--kv-cache-dtype bfloat16" 3 w1,w2,w3; a CPU class is forced by
# exporting its environment first, radixserve/bench/docs.py's class_env). Prints round, workload, args, wall s.
set -euo pipefail
a=$1 b=$2 rounds=${3:-3} workloads=${4:-w1,w2,w3}
for round in $(seq 1 "$rounds"); do
  for w in ${workloads//,/ }; do
    if [ $((round % 2)) = 1 ]; then order=("$a" "$b"); else order=("$b" "$a"); fi
    for args in "${order[@]}"; do
      # shellcheck disable=SC2086  # NOTE: the argument sets are split on purpose
      wall=$(python3 -m radixserve.cli bench --workloads "$w" --modes on $args --output '' --plot '' 2>&1 \
             | grep -oE "wall [0-9.]+" | head -1 | cut -d' ' -f2)
      printf '%s\t%s\t%s\t%s\n' "$round" "$w" "$args" "$wall"
    done
  done
done
