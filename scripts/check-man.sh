#!/usr/bin/env bash
# Every subcommand has a man page, every page renders without a groff warning, and every option a
# command's --help lists is in its man page (or, for resume, in launch's, which it refers to).
set -euo pipefail
bin=$(realpath -e "${1:-$(dirname "$0")/../build/dptrain}") || { echo "no dptrain binary: ${1:-build/dptrain}" >&2; exit 1; }
cd "$(dirname "$0")/.."
status=0
for cmd in $("$bin" --help | awk '/^Subcommands:/{s=1;next} s&&NF{print $1}'); do
  [ -f "man/dptrain-$cmd.1" ] || { echo "missing man page man/dptrain-$cmd.1" >&2; status=1; }
done
for page in man/*.[0-9]; do
  out=$(groff -man -ww -z "$page" 2>&1) || true
  if [ -n "$out" ]; then echo "$page: $out" >&2; status=1; fi
done
# "PAGES|COMMAND WORDS": the pages (with '+' between) that must name each long option.
while IFS='|' read -r pages words; do
  text=$(for p in ${pages//+/ }; do sed 's/\\-/-/g; s/\\f[BIRP]//g' "man/$p"; done)
  # shellcheck disable=SC2086
  for opt in $("$bin" $words --help | grep -oE -- '--[a-z][a-z0-9-]+' | sort -u); do
    [ "$opt" = --help ] && continue
    grep -qF -- "$opt" <<<"$text" || { echo "man/${pages%%+*}: $opt ($words --help) is not in it" >&2; status=1; }
  done
done <<'TABLE'
dptrain.1|
dptrain-launch.1|launch
dptrain-resume.1+dptrain-launch.1|resume
dptrain-status.1|status
dptrain-report.1|report
dptrain-provision.1|provision
dptrain-doctor.1+dptrain-launch.1|doctor
dptrain-sample.1|sample
dptrain-agent.1|agent
dptrain-worker.1|worker
dptrain-bench.1|bench comm
dptrain-bench-train.1|bench train
dptrain-ckpt.1|ckpt list
dptrain-ckpt.1|ckpt verify
dptrain-data.1|data prepare
dptrain-recipe.1|recipe validate
dptrain-recipe.1|recipe show
TABLE
exit $status
