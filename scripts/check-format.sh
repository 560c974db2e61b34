#!/usr/bin/env bash
# Fails listing every tracked C++/CUDA file that clang-format would change.
set -euo pipefail
cd "$(dirname "$0")/.."
bad=()
while IFS= read -r f; do
  [ -f "$f" ] || continue
  clang-format --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done < <(git ls-files '*.cpp' '*.hpp' '*.cu' '*.cuh' 2>/dev/null || find . -name '*.[ch]pp')
if [ ${#bad[@]} -gt 0 ]; then
  echo "clang-format: these files need 'make format':" >&2
  printf '  %s\n' "${bad[@]}" >&2
  exit 1
fi
