#!/usr/bin/env bash
# scripts/bench-compare.sh REV [ROUNDS] [SECTION...]: the `bench` binary of commit REV against
# this working tree's, alternating in one run on this machine, so that a change to the hot path
# is compared with the binary before it before it lands (machines are shared and noisy: two
# runs minutes apart differ more than the change).
#
# REV's tree is checked out in a git worktree under target/bench-compare/ (kept for the next
# run) and built there with a target folder of its own; the working tree's `bench` is built as
# usual (release). Then the two binaries run alternately, ROUNDS times each (default 3), the
# given sections (default `hit`), and each run's figures are printed under its name:
#
#   scripts/bench-compare.sh a3f18be          # hit pairs, thread cache and gate, 3 rounds each
#   scripts/bench-compare.sh HEAD~1 5 hit throughput
#
# At the end, the median over the rounds of every figure, before and after, side by side.
set -euo pipefail

rev="${1:?usage: scripts/bench-compare.sh REV [ROUNDS] [SECTION...]}"
rounds="${2:-3}"
if (($# >= 2)); then shift 2; else shift 1; fi
sections=("$@")
((${#sections[@]} > 0)) || sections=(hit)

# shellcheck source=scripts/rev-worktree.sh
source "$(dirname "${BASH_SOURCE[0]}")/rev-worktree.sh"
echo "building bench at $short (worktree $tree) and the working tree's" >&2
(cd "$tree" && CARGO_TARGET_DIR="$base/target-$short" cargo build -q --release --bin bench)
cargo build -q --release --bin bench
before="$base/target-$short/release/bench"
after="$root/target/release/bench"

out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
for ((i = 1; i <= rounds; i++)); do
    for who in before after; do
        bin="$before"
        [[ "$who" == after ]] && bin="$after"
        echo "--- round $i: $who ($([[ $who == before ]] && echo "$short" || echo "working tree"))"
        "$bin" "${sections[@]}" | tee -a "$out/$who" | grep -E '^[a-z0-9_]+ +[0-9.]+' || true
    done
done

# Median per figure over the rounds (the figure's value: the second column).
median() {
    awk -v name="$1" '$1 == name { print $2 }' "$2" | sort -g |
        awk '{ v[NR] = $1 } END { if (NR) print v[int((NR + 1) / 2)]; else print "-" }'
}
echo
printf '%-40s %14s %14s\n' "figure (median of $rounds)" "$short" "working tree"
for name in $(awk '/^[a-z0-9_]+ +[0-9.]+/ { print $1 }' "$out/after" | awk '!seen[$0]++'); do
    printf '%-40s %14s %14s\n' "$name" "$(median "$name" "$out/before")" "$(median "$name" "$out/after")"
done
