# Sourced by scripts/bench-compare.sh and scripts/hit-probe.sh once `rev` is set: goes to the
# repository's root and sets `root`, `commit` and `short` (REV's hash), `base`
# (target/bench-compare/) and `tree`, REV's worktree there (checked out on first use and kept
# for the next run; its builds go to "$base/target-$short").
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
commit="$(git rev-parse --verify "$rev^{commit}")"
short="$(git rev-parse --short "$commit")"
base="$root/target/bench-compare"
tree="$base/tree-$short"
mkdir -p "$base"
if [[ ! -d "$tree" ]]; then
    git worktree add --detach "$tree" "$commit" >/dev/null
fi
