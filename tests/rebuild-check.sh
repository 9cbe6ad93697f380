#!/usr/bin/env bash
# Fails when a build right after a build compiles anything: a build script
# watching a path that does not exist, or a nested cargo (the harness's) that
# inherited the outer cargo's variables, makes every build a rebuild. Counts
# "Compiling" lines, not time.
#
# Usage: tests/rebuild-check.sh [cargo build arguments]   (default: --workspace --all-targets --locked)
set -euo pipefail
cd "$(dirname "$0")/.."
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--workspace --all-targets --locked)
cargo build "${args[@]}" >/dev/null 2>&1 || cargo build "${args[@]}"
out=$(cargo build "${args[@]}" 2>&1)
compiled=$(grep -c '^ *Compiling ' <<<"$out" || true)
if [ "$compiled" -ne 0 ]; then
    echo "rebuild-check: the second \`cargo build ${args[*]}\` compiled $compiled crate(s):" >&2
    grep '^ *Compiling ' <<<"$out" >&2
    exit 1
fi
echo "rebuild-check: the second \`cargo build ${args[*]}\` compiled nothing"
