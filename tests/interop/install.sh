#!/usr/bin/env bash
# Installs the official Standard Webhooks verifiers the interop receivers
# (tests/interop/receiver.py, receiver.js) are built on, when missing:
#   <dir>/venv        a Python venv with requirements.txt (PyPI standardwebhooks)
#   <dir>/node        node_modules from package.json + package-lock.json (npm standardwebhooks)
# <dir> is $CDC_RELAY_INTEROP_DIR, default ${CARGO_TARGET_DIR:-target}/interop.
# Re-running is cheap: each part is installed again only when its manifest changed.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here/../.."
dir="${CDC_RELAY_INTEROP_DIR:-${CARGO_TARGET_DIR:-target}/interop}"
mkdir -p "$dir"

for tool in python3 node npm; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "interop: $tool not found; install Python 3 (with venv) and Node.js with npm" >&2
        exit 1
    fi
done

stamp_ok() { [ -f "$2" ] && cmp -s "$1" "$2"; }

if ! stamp_ok "$here/requirements.txt" "$dir/venv/.installed"; then
    echo "interop: installing the Python verifier into $dir/venv" >&2
    rm -rf "$dir/venv"
    python3 -m venv "$dir/venv"
    "$dir/venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$here/requirements.txt"
    cp "$here/requirements.txt" "$dir/venv/.installed"
fi

if ! stamp_ok "$here/package-lock.json" "$dir/node/.installed"; then
    echo "interop: installing the Node.js verifier into $dir/node" >&2
    rm -rf "$dir/node"
    mkdir -p "$dir/node"
    cp "$here/package.json" "$here/package-lock.json" "$dir/node/"
    (cd "$dir/node" && npm ci --silent --no-audit --no-fund)
    cp "$here/package-lock.json" "$dir/node/.installed"
fi
