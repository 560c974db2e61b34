#!/usr/bin/env bash
# Every subcommand has a man page, and every page renders without a groff warning.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-build/dptrain}
status=0
for cmd in $("$bin" --help | awk '/^Subcommands:/{s=1;next} s&&NF{print $1}'); do
  [ -f "man/dptrain-$cmd.1" ] || { echo "missing man page man/dptrain-$cmd.1" >&2; status=1; }
done
for page in man/*.[0-9]; do
  out=$(groff -man -ww -z "$page" 2>&1) || true
  if [ -n "$out" ]; then echo "$page: $out" >&2; status=1; fi
done
exit $status
