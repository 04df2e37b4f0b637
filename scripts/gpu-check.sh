#!/usr/bin/env bash
# scripts/gpu-check.sh: the one prepared GPU run of gpualloc's CUDA backend.
#
# On a machine with an NVIDIA GPU it builds (or takes prebuilt) `--features cuda` binaries,
# then runs, each under `timeout`, in this order:
#   1. the backend conformance suite against CUDA (test binaries named conformance_cuda*),
#   2. every other test binary of the workspace (unit tests, the CUDA smoke test, the
#      allocator's integration tests) with GPUALLOC_BACKEND=cuda in the environment
#      (and GPUALLOC_REQUIRE_GPU=1: tests that would skip without a GPU must fail instead;
#      the facade's tests/backend_env.rs, cuda_interop.rs and cuda_request.rs run on CUDA),
#      and the CUDA backend's rule tests written for the emulated driver (cuda-emu's
#      tests/cuda_rules.rs) with GPUALLOC_RULES_ON_DRIVER=1: each scenario that reads no
#      emulator-only knob and finds the GPUs it needs runs against NVIDIA's driver, the
#      others print why they are skipped,
#   3. the bench binary (binaries named bench*) with GPUALLOC_BACKEND=cuda,
#   4. the conformance suite, tests/backend_env.rs and tests/graphs_env.rs again on every other GPU found
#      (GPUALLOC_TEST_DEVICE=k),
#   5. a check that the driver those runs loaded is NVIDIA's (libcuda.so.<driver version>,
#      as the CUDA smoke test reports it),
# and writes one log per step plus summary.txt to $OUT (or target/gpu-check-logs).
# The whole run stays under 8 minutes (GPU_CHECK_BUDGET_S, default 450 s).
#
# Usage:
#   scripts/gpu-check.sh            run on the GPU machine (exit 0 only if every step passed)
#   scripts/gpu-check.sh --prepare  on a build machine: build the binaries into
#                                   target/gpu-bin for a GPU machine without a toolchain
#
# A GPU machine without network may have no Rust toolchain (and rustup cannot download one).
# Then build here with --prepare (same CPU architecture and a glibc no newer than the GPU
# machine's; the script records both and checks the architecture) and send target/gpu-bin
# along with the work tree, e.g. with the device tool's `carry: ["target/gpu-bin"]`
# (its limit is 64 MiB: binaries are built in release and stripped). Then run
# `bash scripts/gpu-check.sh` there; it uses prebuilt binaries whenever they are present
# (GPU_CHECK_BUILD=1 builds with cargo instead, which needs the crates there).
#
# Environment: OUT (log folder), GPU_CHECK_BUDGET_S (total seconds), GPU_BIN_DIR (prebuilt
# folder), GPU_CHECK_FEATURES (cargo features, default "cuda nccl": with `nccl`,
# tests/nccl.rs registers a pool with a one-rank NCCL communicator, all-reduces on it, sleeps
# and wakes it, where libnccl is installed), GPU_CHECK_BENCH_ARGS (arguments for the bench
# binary), GPU_CHECK_BUILD=1 (build even if prebuilt ones exist).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

FEATURES="${GPU_CHECK_FEATURES:-cuda nccl}"
BIN_DIR="${GPU_BIN_DIR:-$ROOT/target/gpu-bin}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-450}"
BENCH_ARGS="${GPU_CHECK_BENCH_ARGS:-}"
START_S="$(date +%s)"
FAILED=0

log() { printf '[gpu-check %4ss] %s\n' "$(($(date +%s) - START_S))" "$*" >&2; }

# Seconds left of the budget, capped at $1.
time_left() {
    local cap="$1" left
    left=$((BUDGET_S - ($(date +%s) - START_S)))
    if ((left < cap)); then echo "$left"; else echo "$cap"; fi
}

# Executables cargo reports in its JSON messages on stdin, of kind "test" or "bin".
executables() {
    local kind="$1"
    if [[ "$kind" == test ]]; then
        grep '"profile":{[^}]*"test":true' || true
    else
        grep '"kind":\["bin"\]' || true
    fi | grep -o '"executable":"[^"]*"' | sed 's/^"executable":"//; s/"$//'
}

# Cargo builds the test and bench binaries with the CUDA feature into $1/{tests,bins}.
build_into() {
    local dest="$1" limit json exe name
    command -v cargo >/dev/null || { log "cargo not found"; return 1; }
    rm -rf "$dest"
    mkdir -p "$dest/tests" "$dest/bins"
    limit="$(time_left 300)"
    log "building tests and bins with --features $FEATURES (release, stripped; limit ${limit}s)"
    export CARGO_PROFILE_RELEASE_STRIP=symbols CARGO_PROFILE_RELEASE_DEBUG=false
    json="$(mktemp)"
    # The emulated driver (cuda-emu) is a test double for machines without a GPU: its tests
    # are not part of a GPU run.
    timeout "$limit" cargo test --workspace --exclude gpualloc-cuda-emu --release \
        --features "$FEATURES" --no-run \
        --message-format=json-render-diagnostics >"$json"
    while read -r exe; do
        name="$(basename "$exe" | sed -E 's/-[0-9a-f]{16}$//')"
        cp "$exe" "$dest/tests/$name"
    done < <(executables test <"$json")
    # Of cuda-emu's tests, the rule tests of the CUDA backend run against a real driver too
    # (GPUALLOC_RULES_ON_DRIVER); the others call the emulator itself.
    timeout "$(time_left 240)" cargo test -p gpualloc-cuda-emu --release --test cuda_rules \
        --no-run --message-format=json-render-diagnostics >"$json"
    while read -r exe; do
        cp "$exe" "$dest/tests/cuda_rules"
    done < <(executables test <"$json")
    timeout "$(time_left 240)" cargo build --workspace --exclude gpualloc-cuda-emu --release \
        --features "$FEATURES" --bins \
        --message-format=json-render-diagnostics >"$json"
    while read -r exe; do
        cp "$exe" "$dest/bins/$(basename "$exe")"
    done < <(executables bin <"$json")
    rm -f "$json"
    {
        echo "arch=$(uname -m)"
        echo "glibc=$(ldd --version 2>/dev/null | head -n1 | grep -oE '[0-9]+\.[0-9]+$' || echo unknown)"
        echo "commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
        echo "features=$FEATURES"
    } >"$dest/BUILD-INFO"
    log "built $(find "$dest/tests" -type f | wc -l) test and $(find "$dest/bins" -type f | wc -l) other binaries ($(du -sh "$dest" | cut -f1))"
}

# Runs one step under the remaining budget; records PASS/FAIL/TIMEOUT in summary.txt.
step() {
    local name="$1" cap="$2" rc=0 limit
    shift 2
    limit="$(time_left "$cap")"
    if ((limit < 5)); then
        echo "SKIP     $name (time budget spent)" >>"$OUT/summary.txt"
        FAILED=1
        return 0
    fi
    log "step $name (limit ${limit}s)"
    timeout --kill-after=5 "$limit" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
    if ((rc == 0)); then
        echo "PASS     $name" >>"$OUT/summary.txt"
    elif ((rc == 124 || rc == 137)); then
        echo "TIMEOUT  $name (${limit}s)" >>"$OUT/summary.txt"
        FAILED=1
    else
        echo "FAIL     $name (exit $rc)" >>"$OUT/summary.txt"
        FAILED=1
    fi
    tail -n 3 "$OUT/$name.log" | sed "s/^/    [$name] /" >&2 || true
}

if [[ "${1:-}" == "--prepare" ]]; then
    build_into "$BIN_DIR"
    size_kib="$(du -sk "$BIN_DIR" | cut -f1)"
    if ((size_kib > 60 * 1024)); then
        log "warning: $BIN_DIR is ${size_kib} KiB, over what the device tool carries (64 MiB)"
    fi
    log "done: carry target/gpu-bin (this machine: $(uname -m)) and run: bash scripts/gpu-check.sh"
    exit 0
fi

OUT="${OUT:-$ROOT/target/gpu-check-logs}"
mkdir -p "$OUT"
: >"$OUT/summary.txt"
export GPUALLOC_BACKEND=cuda GPUALLOC_REQUIRE_GPU=1 RUST_BACKTRACE=1 GPUALLOC_RULES_ON_DRIVER=1
# The driver loaded here must be NVIDIA's: the emulated driver refuses cuInit when this is
# set, so a stray one on the library path fails every CUDA test instead of passing them.
export GPUALLOC_FORBID_EMULATOR=1

# ---- the machine ----
{
    echo "date: $(date -u +%FT%TZ)"
    echo "arch: $(uname -m)"
    echo "kernel: $(uname -r)"
    echo "cpus: $(nproc)"
} >"$OUT/machine.txt"
if ! command -v nvidia-smi >/dev/null; then
    log "nvidia-smi not found: this is not a machine with an NVIDIA GPU"
    echo "FAIL     nvidia-smi (not found)" >>"$OUT/summary.txt"
    exit 2
fi
if ! timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap \
    --format=csv >>"$OUT/machine.txt" 2>&1; then
    log "nvidia-smi failed; see $OUT/machine.txt"
    echo "FAIL     nvidia-smi" >>"$OUT/summary.txt"
    exit 2
fi
timeout 30 nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true
log "GPU: $(sed -n '/^name/{n;p;}' "$OUT/machine.txt" | head -n1)"

# ---- the binaries: prebuilt (carried), or built here ----
use_prebuilt() {
    local built_arch
    built_arch="$(sed -n 's/^arch=//p' "$BIN_DIR/BUILD-INFO")"
    if [[ "$built_arch" != "$(uname -m)" ]]; then
        log "prebuilt binaries are for $built_arch, this machine is $(uname -m): cross-build them"
        echo "FAIL     prebuilt binaries (arch $built_arch)" >>"$OUT/summary.txt"
        exit 1
    fi
    log "using prebuilt binaries ($(tr '\n' ' ' <"$BIN_DIR/BUILD-INFO"))"
    cp "$BIN_DIR/BUILD-INFO" "$OUT/"
}
if [[ "${GPU_CHECK_BUILD:-0}" != 1 && -f "$BIN_DIR/BUILD-INFO" ]]; then
    use_prebuilt
else
    if ! command -v cargo >/dev/null && command -v rustup >/dev/null; then
        log "cargo missing; trying rustup (works only with network access)"
        timeout "$(time_left 60)" rustup toolchain install stable --profile minimal >&2 || true
    fi
    if ! command -v cargo >/dev/null; then
        log "no cargo and no prebuilt binaries in $BIN_DIR."
        log "run 'scripts/gpu-check.sh --prepare' on a build machine and carry target/gpu-bin."
        echo "FAIL     toolchain (no cargo, no prebuilt binaries)" >>"$OUT/summary.txt"
        exit 1
    fi
    # Needs the crates: network access or a vendored/cached registry on this machine.
    BIN_DIR="$ROOT/target/gpu-bin-local"
    if ! build_into "$BIN_DIR" >"$OUT/build.log" 2>&1; then
        tail -n 30 "$OUT/build.log" >&2
        echo "FAIL     build (see build.log)" >>"$OUT/summary.txt"
        exit 1
    fi
    echo "PASS     build" >>"$OUT/summary.txt"
fi

# ---- the runs ----
shopt -s nullglob
conformance=("$BIN_DIR"/tests/conformance_cuda*)
if ((${#conformance[@]} == 0)); then
    echo "MISSING  conformance_cuda (no such test binary was built)" >>"$OUT/summary.txt"
    FAILED=1
fi
for t in "${conformance[@]}"; do
    step "$(basename "$t")" 120 "$t" --nocapture
done
for t in "$BIN_DIR"/tests/*; do
    case "$(basename "$t")" in conformance_cuda*) continue ;; esac
    step "$(basename "$t")" 120 "$t" --nocapture
done
# Every other GPU the machine has: the conformance suite, the generic allocator tests and the
# two-process IPC tests on it (GPUALLOC_TEST_DEVICE), since nothing may assume device 0.
gpus="$(timeout 30 nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
for ((k = 1; k < ${gpus:-1}; k++)); do
    for t in "$BIN_DIR"/tests/{conformance_cuda,backend_env,graphs_env,two_process,import_lifetime,hostile_importer,ipc_export}*; do
        [[ -e "$t" ]] || continue
        step "$(basename "$t")-gpu$k" 60 env GPUALLOC_TEST_DEVICE="$k" "$t" --nocapture
    done
done
benches=("$BIN_DIR"/bins/bench*)
if ((${#benches[@]} == 0)); then
    echo "MISSING  bench (no bench* binary was built)" >>"$OUT/summary.txt"
fi
for b in "${benches[@]}"; do
    # Word splitting of the arguments is intended.
    # shellcheck disable=SC2086
    step "$(basename "$b")" 150 "$b" $BENCH_ARGS
done

# ---- the driver that ran: NVIDIA's, checked positively ----
# The CUDA smoke test prints the file the driver library was loaded from (the mapping that
# holds cuInit). NVIDIA's driver is libcuda.so.<driver version>, the version nvidia-smi shows;
# anything else (a test double, a stale copy) fails the run.
driver_version="$(timeout 30 nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null |
    head -n1 | tr -d ' ' || true)"
loaded="$(sed -n 's/.*driver library: //p' "$OUT/cuda_gpu_smoke.log" 2>/dev/null | head -n1 || true)"
if [[ -n "$driver_version" && -n "$loaded" && "$(basename "$loaded")" == "libcuda.so.$driver_version" ]]; then
    echo "PASS     driver is NVIDIA's ($loaded)" >>"$OUT/summary.txt"
else
    echo "FAIL     driver: loaded '${loaded:-nothing reported}', expected libcuda.so.${driver_version:-?}" \
        >>"$OUT/summary.txt"
    FAILED=1
fi

log "finished in $(($(date +%s) - START_S))s; summary:"
cat "$OUT/summary.txt" >&2
exit "$FAILED"
