#!/usr/bin/env bash
# Soak: a steady request rate through three sidecars sharing a real redis-server and a global
# rule, a policy edit every 30 s, RSS and open fds of each sidecar sampled every 5 s, errors
# counted. Fails if RSS or fds grow beyond a tolerance after warm-up, errors spike, the rate is
# not delivered or an edit is not applied. See bench/README.md.
#
#   bench/soak.sh              10 minutes, release build
#   bench/soak.sh 1800         30 minutes
#   PROFILE=debug bench/soak.sh 60    a short debug run (CI runs `cargo test -p tollgate-sidecar
#                                     --test soak`: 60 s, an edit every 15 s, a sample every 2 s)
#
# It runs the Rust test crates/sidecar/tests/soak.rs (one implementation for CI and bench) and
# writes bench/results/soak-<date>.md. Knobs: RATE (req/s over the 3 sidecars, default 300),
# POLICY_EVERY (s, default 30), SAMPLE_EVERY (s, default 5), OUT_DIR.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
SECS=${1:-${SECS:-600}}
PROFILE=${PROFILE:-release}
OUT_DIR=${OUT_DIR:-$ROOT/bench/results}

say() { printf '[soak] %s\n' "$*" >&2; }

if ! command -v redis-server >/dev/null; then
    say "apt-get install -y redis-server"
    apt-get install -y redis-server >/dev/null 2>&1 || { apt-get update >/dev/null && apt-get install -y redis-server >/dev/null; }
fi

WORK=$(mktemp -d /tmp/tollgate-soak.XXXXXX)
PIDFILE=$WORK/pids
TEST_PID=
cleanup() {
    local rc=$?
    if [[ -n "$TEST_PID" ]] && kill -0 "$TEST_PID" 2>/dev/null; then
        kill -TERM "$TEST_PID" 2>/dev/null || true
        sleep 1
    fi
    # The test kills its children when it ends normally; after an interruption, kill what it
    # recorded (only if the PID still runs the same program, so a reused PID is never hit).
    if [[ -s "$PIDFILE" ]]; then
        while read -r pid name; do
            if [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$name" ]]; then
                kill -KILL "$pid" 2>/dev/null || true
            fi
        done <"$PIDFILE"
    fi
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

flag=()
[[ "$PROFILE" == release ]] && flag=(--release)
say "building the soak test (${PROFILE})"
cargo test "${flag[@]}" -p tollgate-sidecar --test soak --no-run >&2

mkdir -p "$OUT_DIR"
STAMP=$(date +%Y%m%d-%H%M%S)
OUT=$OUT_DIR/soak-$STAMP.md
export TOLLGATE_SOAK_SECS=$SECS
export TOLLGATE_SOAK_RATE=${RATE:-300}
export TOLLGATE_SOAK_POLICY_EVERY=${POLICY_EVERY:-30}
export TOLLGATE_SOAK_SAMPLE_EVERY=${SAMPLE_EVERY:-5}
export TOLLGATE_SOAK_REPORT=$WORK/report.md
export TOLLGATE_SOAK_PIDFILE=$PIDFILE
say "running for ${SECS} s at ${TOLLGATE_SOAK_RATE} req/s (load average $(cut -d' ' -f1 /proc/loadavg))"
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
set +e
cargo test "${flag[@]}" -p tollgate-sidecar --test soak -- --nocapture >"$WORK/test.log" 2>&1 &
TEST_PID=$!
wait "$TEST_PID"
status=$?
TEST_PID=
set -e
grep '^soak:' "$WORK/test.log" >&2 || tail -40 "$WORK/test.log" >&2

{
    echo "# Soak $(date '+%Y-%m-%d %H:%M') ($([[ $status == 0 ]] && echo PASS || echo FAIL))"
    echo
    echo "Command: \`bench/soak.sh $SECS\` (${PROFILE} build, RATE=$TOLLGATE_SOAK_RATE, POLICY_EVERY=$TOLLGATE_SOAK_POLICY_EVERY, SAMPLE_EVERY=$TOLLGATE_SOAK_SAMPLE_EVERY)."
    echo "Commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- crates || echo ' + uncommitted changes in crates/'); $(nproc) CPUs; load average $LOAD_START at the start, $(cut -d' ' -f1-3 /proc/loadavg) at the end (the machine is shared with other builds)."
    echo
    if [[ -s "$TOLLGATE_SOAK_REPORT" ]]; then
        sed -n '1,/^$/p' "$TOLLGATE_SOAK_REPORT" | sed '/^$/d' | sed 's/^/- /'
        sed -n '/^$/,$p' "$TOLLGATE_SOAK_REPORT"
    else
        echo '```'
        tail -40 "$WORK/test.log"
        echo '```'
    fi
} >"$OUT"
say "wrote $OUT"
exit "$status"
