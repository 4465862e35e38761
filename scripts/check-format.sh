#!/usr/bin/env bash
# Fails when a C++ file differs from .clang-format, naming each file and the
# command that fixes it. Uses the clang-format that scripts/install-deps.sh
# puts in the project's environment (DDPKIT_CLANG_FORMAT: another binary;
# Debian bookworm's clang-format 14 mangles concepts and requires clauses).
#
#   scripts/check-format.sh          check every tracked .hpp/.cpp/.h
#   scripts/check-format.sh --fix    reformat them in place
set -euo pipefail
cd "$(dirname "$0")/.."
cf=${DDPKIT_CLANG_FORMAT:-${DDPKIT_VENV:-.venv}/bin/clang-format}
if [[ ! -x $cf ]]; then
  echo "check-format: no $cf (run scripts/install-deps.sh, or set DDPKIT_CLANG_FORMAT)" >&2
  exit 1
fi
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files --cached --others --exclude-standard '*.hpp' '*.cpp' '*.h')
else
  mapfile -t files < <(find include tests examples benchmarks \( -name '*.hpp' -o -name '*.cpp' -o -name '*.h' \) | sort)
fi
if [[ ${1:-} == --fix ]]; then
  "$cf" -i "${files[@]}"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  "$cf" --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if ((${#bad[@]} > 0)); then
  echo "check-format: ${#bad[@]} file(s) differ from .clang-format ($("$cf" --version)):" >&2
  printf '  %s\n' "${bad[@]}" >&2
  echo "fix: scripts/check-format.sh --fix  (or $cf -i FILE)" >&2
  exit 1
fi
echo "check-format: ${#files[@]} files match .clang-format ($("$cf" --version))"
