#!/bin/bash
# `benchmarks/bench_peers.py --engines radixserve` (W1-W3, cold prefill, warm-prefix TTFT, decode at batch 1 and
# 32), two trees side by side: each round runs both trees, one after the other, the order swapped every round.
# Usage: benchmarks/ab_peers.sh OLD_TREE NEW_TREE [ROUNDS] > rows.md (make the trees with
# `git worktree add /tmp/old <commit>`). Prints each run's per-round row of bench_peers.py, prefixed by the tree.
set -euo pipefail
old=$1 new=$2 rounds=${3:-2}
for round in $(seq 1 "$rounds"); do
  if [ $((round % 2)) = 1 ]; then trees="$old $new"; else trees="$new $old"; fi
  for tree in $trees; do
    row=$(cd "$tree" && PYTHONPATH="$tree" python3 benchmarks/bench_peers.py --engines radixserve --rounds 1 \
          --reps 2 --no-docs 2>/dev/null | grep -E '^\| 0 \| radixserve \|')
    printf '| %s | %s %s\n' "$round" "$tree" "${row#| 0 }"
  done
done
