#!/usr/bin/env bash
# Fails when a build right after a build compiles anything: a build script
# watching a path that does not exist, or a nested cargo (the harness's) that
# inherited the outer cargo's variables, makes every build a rebuild. Counts
# "Compiling" lines, not time.
#
# Usage: tests/rebuild-check.sh [--no-first-build] [cargo build arguments]
#        (default arguments: --workspace --all-targets --locked)
#
# --no-first-build counts the very first build: after something else ran
# (the suite, whose harness builds the binaries with a nested cargo), a
# plain build must compile nothing, or that something undid the build.
set -euo pipefail
cd "$(dirname "$0")/.."
first_build=1
if [ "${1:-}" = --no-first-build ]; then
    first_build=
    shift
fi
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--workspace --all-targets --locked)
which=second
if [ -n "$first_build" ]; then
    cargo build "${args[@]}" >/dev/null 2>&1 || cargo build "${args[@]}"
else
    which=first
fi
out=$(cargo build "${args[@]}" 2>&1) || {
    echo "$out" >&2
    exit 1
}
compiled=$(grep -c '^ *Compiling ' <<<"$out" || true)
if [ "$compiled" -ne 0 ]; then
    echo "rebuild-check: the $which \`cargo build ${args[*]}\` compiled $compiled crate(s):" >&2
    grep '^ *Compiling ' <<<"$out" >&2
    exit 1
fi
echo "rebuild-check: the $which \`cargo build ${args[*]}\` compiled nothing"
