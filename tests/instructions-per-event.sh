#!/usr/bin/env bash
# Instructions the hot path runs per event, counted by callgrind (valgrind):
# the in-process pipeline of cdc-relay/examples/hot_path.rs (decode, map,
# window, dispatch, encode, sign both ways, POST to an in-process server
# answering 204) run at SMALL and LARGE events, the difference divided by
# LARGE - SMALL, so start-up and warm-up cancel out. A count, not a time:
# the same binary gives the same figure on a quiet or a loaded machine, so
# two builds compare without alternating. It counts user-space
# instructions only (not system calls, not waiting), the in-process server
# included, and SHA-256 in software (valgrind hides the CPU's SHA
# extensions): a guide to where a change moves work, next to
# tests/perf-ab.sh's CPU per event, never a replacement for it.
#
# Usage: tests/instructions-per-event.sh [SMALL LARGE]   (default 2000 10000)
# Installs valgrind (Debian's package) when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
small=${1:-2000}
large=${2:-10000}
if ! command -v valgrind >/dev/null 2>&1; then
    echo "instructions-per-event: installing valgrind" >&2
    if [ "$(id -u)" = 0 ]; then apt-get install -y valgrind >&2; else sudo apt-get install -y valgrind >&2; fi
fi
cargo build --release --locked -p cdc-relay --example hot_path >&2
bin=${CARGO_TARGET_DIR:-target}/release/examples/hot_path
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
count() { # count EVENTS: the instructions of one run
    valgrind --tool=callgrind --callgrind-out-file="$out/cg.$1" "$bin" "$1" 2>"$out/log.$1" >/dev/null \
        || { cat "$out/log.$1" >&2; exit 1; }
    sed -n 's/.*Collected : \([0-9]*\).*/\1/p' "$out/log.$1"
}
a=$(count "$small")
b=$(count "$large")
echo "instructions: $small events $a, $large events $b: $(( (b - a) / (large - small) )) per event"
