#!/usr/bin/env bash
# Relay CPU per event, one or more references against the working tree,
# alternating: builds each REF's relay once (a side target directory shared
# by all references, so their dependencies compile once), then runs the
# null-sink drain of the bench (scenario b, --max-in-flight 64, both
# signature schemes) N rounds. A round runs every build once, the first REF
# ... the last REF, HEAD; the next round runs them in the reverse order
# (ABBA), so a load that drifts during the sitting weighs on every build
# alike. The relay binaries are copied in turn to target/release/cdc-relay
# (the same bench, Orders and database for all). Prints each run's figure,
# and for each build its median and its ratio to the FIRST REF: per round,
# and of the medians.
#
# Run it against the previous release before a change to the pipeline
# lands, and write its result in docs/benchmarks.md. With several REFs it
# is a bisect in one sitting: `tests/perf-ab.sh OLD,MID1,MID2 3` says how
# much of the gap between OLD and HEAD each stretch of history added. CPU
# per event is the figure because it is steadier than events/s on a shared
# box; compare ratios from one run, never microseconds across runs.
#
# Usage: tests/perf-ab.sh REF[,REF...] [N] [extra bench arguments]   (N defaults to 3)
#
# Extra bench arguments for one side only: PERF_AB_REF_ARGS (every REF) and
# PERF_AB_HEAD_ARGS (split on spaces). REF "." is the working tree's relay,
# for an A/B of a relay option on one build, e.g. tracing:
#   PERF_AB_HEAD_ARGS=--traced tests/perf-ab.sh . 3
set -euo pipefail
cd "$(dirname "$0")/.."
refs_arg=${1:?"usage: tests/perf-ab.sh REF[,REF...] [N] [extra bench arguments]"}
n=${2:-3}
shift $(( $# >= 2 ? 2 : 1 ))
extra=("$@")
read -r -a ref_args <<<"${PERF_AB_REF_ARGS:-}"
read -r -a head_args <<<"${PERF_AB_HEAD_ARGS:-}"
dir=target/perf-ab
side="$PWD/$dir/target-refs"
mkdir -p "$dir"

echo "perf-ab: building the working tree (release)" >&2
# Two builds: `--bin` would restrict the other packages to that binary too.
cargo build --release --locked -p cdc-relay-tests --bin bench >&2
cargo build --release --locked -p cdc-relay -p orders -p billing -p payments >&2
head="$dir/cdc-relay-head"
cp target/release/cdc-relay "$head"
restore() { cp "$head" target/release/cdc-relay; }
trap restore EXIT

# The builds, in run order: labels, binaries, bench arguments (one string).
labels=(); bins=(); args=()
IFS=, read -r -a refs <<<"$refs_arg"
for ref in "${refs[@]}"; do
    if [ "$ref" = . ]; then
        labels+=("HEAD${PERF_AB_REF_ARGS:+ $PERF_AB_REF_ARGS}")
        bins+=("$head")
    else
        commit=$(git rev-parse --verify "$ref^{commit}")
        short=${commit:0:12}
        bin="$dir/cdc-relay-$short"
        if [ ! -x "$bin" ]; then
            echo "perf-ab: building cdc-relay at $short in $side" >&2
            tree=$(mktemp -d)
            git worktree add --detach "$tree" "$commit" >/dev/null
            (cd "$tree" && CDC_RELAY_GIT_COMMIT="$short" cargo build --release --locked -p cdc-relay --target-dir "$side") >&2
            cp "$side/release/cdc-relay" "$bin"
            git worktree remove --force "$tree"
        fi
        labels+=("$short${PERF_AB_REF_ARGS:+ $PERF_AB_REF_ARGS}")
        bins+=("$bin")
    fi
    args+=("${ref_args[*]}")
done
labels+=("HEAD${PERF_AB_HEAD_ARGS:+ $PERF_AB_HEAD_ARGS}")
bins+=("$head")
args+=("${head_args[*]}")
builds=${#bins[@]}

run() { # run INDEX ROUND: one drain with build INDEX; prints "µs/event ev/s load [spans]"
    local b=$1 round=$2 out load side_args
    cp "${bins[$b]}" target/release/cdc-relay
    out="$dir/build$b-$round.json"
    read -r -a side_args <<<"${args[$b]}"
    load=$(cut -d' ' -f1 /proc/loadavg)
    CDC_RELAY_SKIP_BUILD=1 target/release/bench --only b --sinks null --mif 64 --no-baselines \
        --out "$out" "${extra[@]}" "${side_args[@]}" >/dev/null 2>"$dir/build$b-$round.log" \
        || { tail -20 "$dir/build$b-$round.log" >&2; exit 1; }
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

figures="$dir/figures.tsv"
: >"$figures"
for round in $(seq 1 "$n"); do
    if (( round % 2 )); then order=$(seq 0 $((builds - 1))); else order=$(seq $((builds - 1)) -1 0); fi
    for b in $order; do
        got=$(run "$b" "$round")
        read -r us rate info <<<"$got"
        printf 'round %d: %s %s µs/event (%s ev/s, %s)\n' "$round" "${labels[$b]}" "$us" "$rate" "$info"
        printf '%d\t%d\t%s\n' "$round" "$b" "$us" >>"$figures"
    done
done
python3 - "$figures" "${labels[@]}" <<'EOF'
import collections, statistics, sys
labels = sys.argv[2:]
by = collections.defaultdict(dict)
for line in open(sys.argv[1]):
    r, b, us = line.split()
    by[int(b)][int(r)] = float(us)
base = by[0]
rounds = sorted(base)
print(f"ratios to {labels[0]} (per round: that round's run of {labels[0]}):")
for b, label in enumerate(labels):
    runs = by[b]
    med = statistics.median(runs.values())
    per = [runs[r] / base[r] for r in rounds]
    print(f"  {label}: median {med:.2f} µs/event, {med / statistics.median(base.values()):.2f}x of the medians; "
          f"per round {' '.join('%.2f' % p for p in per)} (median {statistics.median(per):.2f}x, n = {len(rounds)})")
EOF
