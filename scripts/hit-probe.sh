#!/usr/bin/env bash
# scripts/hit-probe.sh REV [ROUNDS]: the hit path of commit REV against this working tree's, in
# two measures that a noisy shared machine cannot blur:
#
# - instructions per hit pair (malloc + free of 4 KiB, a cache hit), counted by valgrind's
#   callgrind: deterministic, so a change of a few instructions shows. The count is the
#   difference between runs of 20,000 and 10,000 pairs (start-up cancels out).
# - ns per pair of a tight loop of 1M pairs (3M with the thread cache), the two binaries
#   alternating ROUNDS times (default 8): the minimum and the median of each.
#
# For each path: the device core alone (`core`), the allocator with its thread cache (`tc`),
# and through the gate (`gate`, `thread_cache:False`). The loop is scripts/hit_probe.rs, built
# as an example of the root package at REV (in the worktree scripts/bench-compare.sh keeps
# under target/bench-compare/) and in the working tree, with `codegen-units=1` and fat LTO, as
# a release is measured. Needs valgrind.
#
#   scripts/hit-probe.sh a3f18be
#
# `bench hit` (scripts/bench-compare.sh) stays the reference figure; this one says where a
# difference comes from (`callgrind_annotate` on the files it leaves in target/hit-probe/).
set -euo pipefail

rev="${1:?usage: scripts/hit-probe.sh REV [ROUNDS]}"
rounds="${2:-8}"
command -v valgrind >/dev/null || { echo "hit-probe: needs valgrind" >&2; exit 2; }

# shellcheck source=scripts/rev-worktree.sh
source "$(dirname "${BASH_SOURCE[0]}")/rev-worktree.sh"
out="$root/target/hit-probe"
mkdir -p "$out"

export CARGO_PROFILE_RELEASE_LTO=fat CARGO_PROFILE_RELEASE_CODEGEN_UNITS=1
export CARGO_PROFILE_RELEASE_DEBUG=line-tables-only CARGO_INCREMENTAL=0
build() { # DIR TARGET_DIR -> copies the probe in, builds it, takes it out again
    local dir="$1" target="$2"
    cp "$root/scripts/hit_probe.rs" "$dir/examples/hit_probe.rs"
    (cd "$dir" && CARGO_TARGET_DIR="$target" cargo build -q --release --example hit_probe) || {
        rm -f "$dir/examples/hit_probe.rs"
        exit 1
    }
    rm -f "$dir/examples/hit_probe.rs"
}
echo "building the probe at $short and in the working tree" >&2
build "$tree" "$base/target-$short"
build "$root" "$root/target"
cp "$base/target-$short/release/examples/hit_probe" "$out/before"
cp "$root/target/release/examples/hit_probe" "$out/after"

count() { # BIN MODE -> instructions per pair
    local a b
    a=$(valgrind --tool=callgrind --callgrind-out-file="$out/cg.$(basename "$1").$2.10k" "$1" "$2" 10000 2>&1 |
        awk '/Collected/ { print $NF }')
    b=$(valgrind --tool=callgrind --callgrind-out-file="$out/cg.$(basename "$1").$2.20k" "$1" "$2" 20000 2>&1 |
        awk '/Collected/ { print $NF }')
    echo $(((b - a) / 10000))
}
printf '%-6s %22s %22s\n' path "instructions $short" "instructions tree"
for mode in core tc gate; do
    printf '%-6s %22s %22s\n' "$mode" "$(count "$out/before" $mode)" "$(count "$out/after" $mode)"
done

echo
printf '%-6s %-12s %22s %22s\n' path "ns per pair" "$short" "working tree"
for mode in core tc gate; do
    n=1000000
    [[ $mode == tc ]] && n=3000000
    : >"$out/t.before"
    : >"$out/t.after"
    for ((i = 0; i < rounds; i++)); do
        for who in before after; do
            "$out/$who" "$mode" "$n" | awk '{ print $2 }' >>"$out/t.$who"
        done
    done
    stat() { sort -g "$1" | awk '{ v[NR] = $1 } END { printf "%.1f / %.1f", v[1], v[int((NR + 1) / 2)] }'; }
    printf '%-6s %-12s %22s %22s\n' "$mode" "min / median" "$(stat "$out/t.before")" "$(stat "$out/t.after")"
done
