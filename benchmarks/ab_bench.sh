#!/bin/bash
# `radixserve bench`, two trees side by side: for each round, workload and loop, both trees back to back,
# the order swapped every round. Usage: benchmarks/ab_bench.sh OLD_TREE NEW_TREE [ROUNDS] > walls.tsv
# (make the trees with `git worktree add /tmp/old <commit>`). Prints round, workload, loop, tree, wall s.
set -euo pipefail
old=$1 new=$2 rounds=${3:-3}
for round in $(seq 1 "$rounds"); do
  for w in w1 w2 w3; do
    for loop in overlap normal; do
      if [ $((round % 2)) = 1 ]; then trees="$old $new"; else trees="$new $old"; fi
      for tree in $trees; do
        extra=(); [ "$loop" = normal ] && extra=(--disable-overlap-schedule)
        wall=$(cd "$tree" && PYTHONPATH="$tree" python3 -m radixserve.cli bench --workloads "$w" \
               --modes on --torch-threads 1 "${extra[@]}" --output '' --plot '' 2>&1 \
               | grep -oE "wall [0-9.]+" | head -1 | cut -d' ' -f2)
        printf '%s\t%s\t%s\t%s\t%s\n' "$round" "$w" "$loop" "$tree" "$wall"
      done
    done
  done
done
