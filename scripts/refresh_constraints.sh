#!/usr/bin/env bash
# Re-resolves constraints.txt: runs scripts/setup.sh unpinned in a brand-new venv (no system site-packages)
# and writes what it installed. Then run the suite on a fresh venv built from the new file before committing
# it (.ci/run does exactly that).
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d -t radixserve-lock.XXXXXX)
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
(. "$work/venv/bin/activate" && RADIXSERVE_UNPINNED=1 bash scripts/setup.sh)
{
  echo "# Every package scripts/setup.sh installs, at the versions that were tested together."
  echo "# Written by scripts/refresh_constraints.sh on $(date -u +%F) with $("$work/venv/bin/python" -V);"
  echo "# local version labels (torch's +cpu) dropped, so each pin matches any build of that release."
  "$work/venv/bin/python" -m pip freeze --exclude-editable | sed -e 's/+[A-Za-z0-9.]*$//' | LC_ALL=C sort -f
} > constraints.txt
echo "wrote constraints.txt ($(grep -vc '^#' constraints.txt) packages)"
