#!/usr/bin/env bash
# Checks the deploy/ material:
#   - Prometheus: `promtool check config`, `promtool check rules`, and the
#     rule unit tests (`promtool test rules`).
#   - Every alert carries a runbook_url to a section of docs/operations.md
#     as installed (/usr/share/doc/cdc-relay/).
#   - Grafana: the dashboard is valid JSON.
#   - Dashboard and alert rules name only metrics the code registers
#     (cdc-relay/src/metrics.rs, the services' metrics).
#   - systemd: `systemd-analyze verify` on the units, and on instance 0 of
#     each template unit (cdc-relay@.service as cdc-relay@0.service), when
#     systemd-analyze is installed (skipped with a note otherwise).
#   - Kubernetes (deploy/kubernetes/): yamllint over deploy/'s YAML; every
#     manifest validated strictly against the Kubernetes schemas bundled in
#     the PyPI package kubernetes-validate (the versions in K8S_VERSIONS),
#     the objects' selectors, ports and labels checked against each other,
#     the replicas and the PodDisruptionBudget against the sharding in the
#     ConfigMap (kubernetes/validate.py); the PrometheusRule is exactly what
#     kubernetes/gen-prometheusrule.sh makes from prometheus/alerts.yml and
#     carries the same rules; the Dockerfile builds with the Rust version of
#     rust-toolchain.toml.
#
# promtool comes from Debian's `prometheus` package. When it is missing and
# this runs as root on Debian/Ubuntu, only the promtool binary is taken from
# that package (downloaded, unpacked, copied to /usr/local/bin): no Prometheus
# server gets installed or started. Otherwise the script says what to install.
#
# kubernetes-validate and yamllint (pinned in kubernetes/requirements.txt)
# are installed from PyPI into a venv, ${CARGO_TARGET_DIR:-target}/deploy-venv,
# again only when the requirements change.
#
# Usage: deploy/check.sh        (exits non-zero on the first failure)
set -euo pipefail
cd "$(dirname "$0")"
repo=$(cd .. && pwd)

# The Kubernetes versions the manifests must be valid for: the three newest
# minors that kubernetes-validate==1.37.0 carries schemas for.
K8S_VERSIONS=(1.35 1.36 1.37)

step() { echo "== $*"; }
fail() { echo "deploy/check.sh: $*" >&2; exit 1; }

install_promtool() {
    echo "promtool not found: taking it from Debian's prometheus package" >&2
    local work
    work=$(mktemp -d)
    # apt downloads as its sandbox user _apt, which must be able to write here.
    chown _apt "$work" 2>/dev/null || true
    apt-get update -qq
    (cd "$work" && apt-get download -qq prometheus >/dev/null)
    dpkg-deb -x "$work"/prometheus_*.deb "$work/root"
    install -m 0755 "$work/root/usr/bin/promtool" /usr/local/bin/promtool
    rm -rf "$work"
}

if ! command -v promtool >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && command -v dpkg-deb >/dev/null 2>&1; then
        install_promtool
    else
        echo "promtool not found. Install it, then run this again:" >&2
        echo "    sudo apt-get install prometheus      # Debian/Ubuntu (ships promtool)" >&2
        echo "or put a promtool binary from https://prometheus.io/download/ on PATH." >&2
        exit 1
    fi
fi

step "promtool check config prometheus/prometheus.yml"
promtool check config prometheus/prometheus.yml

step "promtool check rules prometheus/alerts.yml"
promtool check rules prometheus/alerts.yml

step "promtool test rules prometheus/alerts_test.yml"
promtool test rules prometheus/alerts_test.yml

step "every alert has a runbook_url naming a section of docs/operations.md"
python3 - "$repo/docs/operations.md" prometheus/alerts.yml <<'PY'
import re, sys
doc, rules = sys.argv[1], sys.argv[2]
# GitHub's heading anchors: lower case, punctuation other than '-' dropped,
# spaces to '-'.
anchors = set()
for line in open(doc, encoding="utf-8"):
    m = re.match(r"#{1,6} (.+)", line)
    if m:
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        anchors.add(slug)
text = open(rules, encoding="utf-8").read()
alerts = re.findall(r"^\s*- alert: (\S+)", text, re.M)
urls = re.findall(r'^\s*runbook_url: "file:///usr/share/doc/cdc-relay/operations\.md#([^"]+)"', text, re.M)
bad = [u for u in urls if u not in anchors]
if len(urls) != len(alerts) or bad:
    sys.exit(f"{rules}: {len(alerts)} alerts, {len(urls)} runbook_url annotations "
             f"(file:///usr/share/doc/cdc-relay/operations.md#...); anchors not in {doc}: {bad}")
print(f"{len(alerts)} alerts, each with a runbook_url to an existing section")
PY

step "grafana/cdc-relay.json is valid JSON, its queries valid PromQL"
if command -v python3 >/dev/null 2>&1; then
    # Each panel query becomes a recording rule, so promtool parses it.
    queries=$(mktemp --suffix=.yml)
    python3 - grafana/cdc-relay.json >"$queries" <<'PY'
import json, sys
dash = json.load(open(sys.argv[1]))
print("groups:\n  - name: dashboard\n    rules:")
n = 0
for panel in dash["panels"]:
    for t in panel.get("targets", []):
        n += 1
        expr = t["expr"].replace("$__rate_interval", "5m")
        print(f"      - record: dashboard:query_{n}\n        expr: {json.dumps(expr)}")
PY
    promtool check rules "$queries" || { rm -f "$queries"; fail "a dashboard query is not valid PromQL"; }
    rm -f "$queries"
elif command -v jq >/dev/null 2>&1; then
    jq empty grafana/cdc-relay.json
else
    echo "   (neither python3 nor jq found: JSON syntax left to the system test" \
        "observability::deploy_files_reference_only_registered_metrics)"
fi

step "dashboard and alert rules use only registered metrics"
registered=$(
    {
        grep -ohE '"cdc_relay_[a-z0-9_]+"' "$repo/cdc-relay/src/metrics.rs" "$repo/cdc-relay/src/endpoint_metrics.rs"
        grep -ohE '"(orders|billing)_[a-z0-9_]+"' "$repo"/services/*/src/*.rs
        # The trace export's counters, registered under each process's prefix.
        for prefix in cdc_relay orders billing; do
            grep -ohE '"\{prefix\}_trace_[a-z0-9_]+"' "$repo/trace-context/src/export.rs" | sed "s/{prefix}/${prefix}/"
        done
        for svc in orders billing; do
            grep -ohE '"http_[a-z0-9_]+"' "$repo/services/common/src/metrics.rs" | sed "s/^\"/\"${svc}_/"
        done
    } | tr -d '"' | sort -u
)
referenced=$(
    grep -ohE '\b(cdc_relay|orders|billing)_[a-z0-9_]*[a-z]\b' \
        grafana/cdc-relay.json prometheus/alerts.yml prometheus/alerts_test.yml |
        sed -E 's/(_seconds)_(bucket|sum|count)$/\1/' | sort -u
)
unknown=$(comm -13 <(echo "$registered") <(echo "$referenced"))
[ -z "$unknown" ] || fail "metrics referenced but not registered anywhere:"$'\n'"$unknown"
echo "   $(echo "$referenced" | wc -l) metric names, all registered"

step "systemd-analyze verify systemd/*.service"
if command -v systemd-analyze >/dev/null 2>&1; then
    # verify insists that ExecStart= exists and is executable: check the units
    # as written, with stand-in executables at their binaries' paths.
    units=$(mktemp -d)
    trap 'rm -rf "$units"' EXIT
    mkdir "$units/bin"
    for unit in systemd/*.service; do
        for bin in $(sed -n 's#^ExecStart=/usr/local/bin/\([^ ]*\).*#\1#p' "$unit"); do
            cp "$(type -P true)" "$units/bin/$bin"
        done
        sed "s#/usr/local/bin/#$units/bin/#" "$unit" >"$units/$(basename "$unit")"
    done
    # A template is verified as itself and as an instance (%i expanded).
    instances=()
    for template in "$units"/*@.service; do
        [ -e "$template" ] && instances+=("${template%@.service}@0.service")
    done
    # verify only warns about unknown keys and bad values: fail on any line
    # about our units too (lines about the host's own units are not ours).
    out=$(systemd-analyze verify "$units"/*.service "${instances[@]}" 2>&1) || fail "systemd-analyze verify:"$'\n'"$out"
    ours=$(grep -E "$units|(cdc-relay(@[^ ]*)?|orders|billing)\.service" <<<"$out" || true)
    [ -z "$ours" ] || fail "systemd-analyze verify:"$'\n'"$ours"
    echo "   $(ls systemd/*.service | wc -l) units verified, ${#instances[@]} of them templates (also as instance 0)"
else
    echo "   systemd-analyze not installed: skipped"
fi

step "kubernetes: kubernetes-validate and yamllint in a venv"
command -v python3 >/dev/null 2>&1 || fail "python3 (with venv) is needed for the Kubernetes checks"
target="${CARGO_TARGET_DIR:-target}"
case "$target" in /*) ;; *) target="$repo/$target" ;; esac
venv="$target/deploy-venv"
if [ -f "$venv/.installed" ] && cmp -s kubernetes/requirements.txt "$venv/.installed"; then
    echo "   up to date ($venv)"
else
    echo "   installing kubernetes/requirements.txt into $venv"
    rm -rf "$venv"
    mkdir -p "$target"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r kubernetes/requirements.txt
    cp kubernetes/requirements.txt "$venv/.installed"
fi

step "yamllint (kubernetes/yamllint.yml) kubernetes/ prometheus/"
"$venv/bin/yamllint" --strict -c kubernetes/yamllint.yml kubernetes/ prometheus/ ||
    fail "yamllint found problems"

step "kubernetes/*.yaml valid against Kubernetes ${K8S_VERSIONS[*]}, wired together"
"$venv/bin/python" kubernetes/validate.py "${K8S_VERSIONS[@]}" ||
    fail "the Kubernetes manifests do not validate"

step "kubernetes/prometheusrule.yaml is generated from prometheus/alerts.yml"
kubernetes/gen-prometheusrule.sh --check || fail "prometheusrule.yaml is out of date"

step "the Dockerfile builds with rust-toolchain.toml's Rust"
toolchain=$(sed -n 's/^channel = "\(.*\)"$/\1/p' "$repo/rust-toolchain.toml")
image=$(sed -n 's/^ARG RUST_VERSION=\(.*\)$/\1/p' "$repo/Dockerfile")
[ -n "$toolchain" ] && [ "$toolchain" = "$image" ] ||
    fail "the Dockerfile's RUST_VERSION is '$image', rust-toolchain.toml's channel '$toolchain'"
echo "   Rust $image"

echo "deploy/check.sh: all checks passed"
