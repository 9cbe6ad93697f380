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
set -euo pipefail
cd "$(dirname "$0")/.."
ref=${1:?"usage: tests/perf-ab.sh REF [N] [extra bench arguments]"}
n=${2:-3}
shift $(( $# >= 2 ? 2 : 1 ))
extra=("$@")
commit=$(git rev-parse --verify "$ref^{commit}")
short=${commit:0:12}
dir=target/perf-ab
side="$PWD/$dir/target-$short"
mkdir -p "$dir"

if [ ! -x "$side/release/cdc-relay" ]; then
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

run() { # run BUILD INDEX BINARY
    cp "$3" target/release/cdc-relay
    local out="$dir/$1-$2.json"
    CDC_RELAY_SKIP_BUILD=1 target/release/bench --only b --sinks null --mif 64 --no-baselines \
        --out "$out" "${extra[@]}" >/dev/null 2>"$dir/$1-$2.log" || { tail -20 "$dir/$1-$2.log" >&2; exit 1; }
    python3 - "$out" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
cpu = [r for r in rows if r["figure"].startswith("CPU per event, mif 64")]
rate = [r for r in rows if r["figure"].startswith("max-in-flight 64")]
print("%.2f %.0f" % (cpu[0]["contenders"]["ours"]["median"], rate[0]["contenders"]["ours"]["median"]))
EOF
}

refs=(); heads=()
for i in $(seq 1 "$n"); do
    got=$(run ref "$i" "$side/release/cdc-relay")
    read -r r rr <<<"$got"
    got=$(run head "$i" "$head")
    read -r h hr <<<"$got"
    refs+=("$r"); heads+=("$h")
    printf 'pair %d: %s %s µs/event (%s ev/s), HEAD %s µs/event (%s ev/s): %s\n' "$i" "$short" "$r" "$rr" "$h" "$hr" \
        "$(python3 -c "print('%.2fx' % ($h / $r))")"
done
python3 - "$short" "${refs[*]}" "${heads[*]}" <<'EOF'
import statistics, sys
short, refs, heads = sys.argv[1], [float(x) for x in sys.argv[2].split()], [float(x) for x in sys.argv[3].split()]
r, h = statistics.median(refs), statistics.median(heads)
print(f"median: {short} {r:.2f} µs/event, HEAD {h:.2f} µs/event: HEAD/{short} = {h / r:.2f}x (n = {len(refs)} pairs)")
EOF
