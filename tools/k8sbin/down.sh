#!/usr/bin/env bash
# Stop the control plane started by up.sh RUN_DIR: kills exactly the PIDs recorded in
# RUN_DIR/{kube-apiserver,etcd}.pid (after checking that each PID still runs a command
# that mentions RUN_DIR, so a recycled PID is never hit), then removes etcd-data/, pki/,
# kubeconfig, env and the pid files. Logs (*.log) are kept for post-mortems.
set -uo pipefail
RUN=${1:?usage: down.sh RUN_DIR}
[ -d "$RUN" ] || exit 0
RUN=$(cd "$RUN" && pwd)
log() { printf '[k8sbin] %s\n' "$*" >&2; }

# running PID: exists and is not a zombie (PID 1 in containers may not reap).
running() { [ -r "/proc/$1/stat" ] && [ "$(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null)" != Z ]; }

stop() {
  local f="$RUN/$1.pid" pid
  [ -s "$f" ] || return 0
  pid=$(cat "$f")
  if [ -r "/proc/$pid/cmdline" ] && tr '\0' ' ' < "/proc/$pid/cmdline" | grep -qF "$RUN/"; then
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 100); do running "$pid" || break; sleep 0.1; done
    if running "$pid"; then log "$1 ($pid) ignored SIGTERM, sending SIGKILL"; kill -KILL "$pid" 2>/dev/null; fi
    log "$1 ($pid) stopped"
  else
    log "$1: pid $pid not running (or not ours), skipping"
  fi
  rm -f "$f"
}
# apiserver first, so it does not spin on a vanished etcd.
stop kube-apiserver
stop etcd
rm -rf "$RUN/etcd-data" "$RUN/pki" "$RUN/helm" "$RUN/kubeconfig" "$RUN/env"
