#!/usr/bin/env bash
# Relay CPU per event, REF against the working tree, alternating: builds
# REF's relay in a side target directory (once), then runs the null-sink
# drain of the bench (scenario b, --max-in-flight 64, both signature
# schemes) N times per build, REF then HEAD then REF ..., the two relay
# binaries copied in turn to target/release/cdc-relay (the same bench,
# Orders and database for both). Prints each run's figure, each build's
# median and the ratio HEAD/REF per pair and of the medians.
#
# Run it against the previous release before a change to the pipeline
# lands, and write its result in docs/benchmarks.md. CPU per event is the
# figure because it is steadier than events/s on a shared box; compare
# ratios from one run, never milliseconds across runs.
#
# Usage: tests/perf-ab.sh REF [N] [extra bench arguments]   (N defaults to 3)
#
# Extra bench arguments for one side only: PERF_AB_REF_ARGS and
# PERF_AB_HEAD_ARGS (split on spaces). REF "." is the working tree's relay
# on both sides, for an A/B of a relay option on one build, e.g. tracing:
#   PERF_AB_HEAD_ARGS=--traced tests/perf-ab.sh . 3
set -euo pipefail
cd "$(dirname "$0")/.."
ref=${1:?"usage: tests/perf-ab.sh REF [N] [extra bench arguments]"}
n=${2:-3}
shift $(( $# >= 2 ? 2 : 1 ))
extra=("$@")
read -r -a ref_args <<<"${PERF_AB_REF_ARGS:-}"
read -r -a head_args <<<"${PERF_AB_HEAD_ARGS:-}"
dir=target/perf-ab
mkdir -p "$dir"
if [ "$ref" = . ]; then
    short=HEAD
    side=
else
    commit=$(git rev-parse --verify "$ref^{commit}")
    short=${commit:0:12}
    side="$PWD/$dir/target-$short"
fi
ref_label="$short${PERF_AB_REF_ARGS:+ $PERF_AB_REF_ARGS}"
head_label="HEAD${PERF_AB_HEAD_ARGS:+ $PERF_AB_HEAD_ARGS}"

if [ -n "$side" ] && [ ! -x "$side/release/cdc-relay" ]; then
    echo "perf-ab: building cdc-relay at $short in $side" >&2
    tree=$(mktemp -d)
    git worktree add --detach "$tree" "$commit" >/dev/null
    (cd "$tree" && CDC_RELAY_GIT_COMMIT="$short" cargo build --release --locked -p cdc-relay --target-dir "$side") >&2
    git worktree remove --force "$tree"
fi
echo "perf-ab: building the working tree (release)" >&2
# Two builds: `--bin` would restrict the other packages to that binary too.
cargo build --release --locked -p cdc-relay-tests --bin bench >&2
cargo build --release --locked -p cdc-relay -p orders -p billing -p payments >&2
head="$dir/cdc-relay-head"
cp target/release/cdc-relay "$head"
restore() { cp "$head" target/release/cdc-relay; }
trap restore EXIT

ref_bin="${side:+$side/release/cdc-relay}"
ref_bin=${ref_bin:-$head}

run() { # run BUILD INDEX BINARY [bench arguments of this side]
    cp "$3" target/release/cdc-relay
    local out="$dir/$1-$2.json" load
    load=$(cut -d' ' -f1 /proc/loadavg)
    CDC_RELAY_SKIP_BUILD=1 target/release/bench --only b --sinks null --mif 64 --no-baselines \
        --out "$out" "${extra[@]}" "${@:4}" >/dev/null 2>"$dir/$1-$2.log" || { tail -20 "$dir/$1-$2.log" >&2; exit 1; }
    python3 - "$out" "$load" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
cpu = [r for r in rows if r["figure"].startswith("CPU per event, mif 64")]
rate = [r for r in rows if r["figure"].startswith("max-in-flight 64")]
spans = [r for r in rows if r["figure"].startswith("OTLP spans received, mif 64")]
extra = ", %.0f spans" % spans[0]["contenders"]["ours"]["median"] if spans else ""
print("%.2f %.0f load %s%s" % (cpu[0]["contenders"]["ours"]["median"], rate[0]["contenders"]["ours"]["median"], sys.argv[2], extra))
EOF
}

refs=(); heads=()
for i in $(seq 1 "$n"); do
    got=$(run ref "$i" "$ref_bin" "${ref_args[@]}")
    read -r r rr rinfo <<<"$got"
    got=$(run head "$i" "$head" "${head_args[@]}")
    read -r h hr hinfo <<<"$got"
    refs+=("$r"); heads+=("$h")
    printf 'pair %d: %s %s µs/event (%s ev/s, %s), %s %s µs/event (%s ev/s, %s): %s\n' "$i" \
        "$ref_label" "$r" "$rr" "$rinfo" "$head_label" "$h" "$hr" "$hinfo" \
        "$(python3 -c "print('%.2fx' % ($h / $r))")"
done
python3 - "$ref_label" "$head_label" "${refs[*]}" "${heads[*]}" <<'EOF'
import statistics, sys
rl, hl = sys.argv[1], sys.argv[2]
refs, heads = [float(x) for x in sys.argv[3].split()], [float(x) for x in sys.argv[4].split()]
r, h = statistics.median(refs), statistics.median(heads)
print(f"median: {rl} {r:.2f} µs/event, {hl} {h:.2f} µs/event: ({hl})/({rl}) = {h / r:.2f}x (n = {len(refs)} pairs)")
EOF
