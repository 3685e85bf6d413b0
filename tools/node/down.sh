#!/usr/bin/env bash
# Stop the node started by up.sh RUN_DIR: the pods' processes (found by their cgroups), the
# daemons (by the PIDs up.sh recorded, checked to be in the run's namespaces so a recycled PID
# is never hit), anything else left in those namespaces (containerd shims), then the namespace
# holder; the namespaces and every mount made in them disappear with their last process. Finally
# the cgroup directories the kubelet and containerd made are removed. Logs are kept.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
RUN=${1:?usage: down.sh RUN_DIR}
[ -d "$RUN" ] || exit 0
RUN=$(cd "$RUN" && pwd)
log() { printf '[node] %s\n' "$*" >&2; }
# shellcheck source=lib.sh
. "$HERE/lib.sh"
MNT=$(cat "$RUN/mntns" 2>/dev/null || true)

ours() { [ -n "$MNT" ] && [ "$(readlink "/proc/$1/ns/mnt" 2>/dev/null)" = "$MNT" ]; }
stop() { # name
  local f="$RUN/$1.pid" pid
  [ -s "$f" ] || return 0
  pid=$(cat "$f"); rm -f "$f"
  running "$pid" && ours "$pid" || return 0
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 50); do running "$pid" || break; sleep 0.1; done
  running "$pid" && { log "$1 ($pid) ignored SIGTERM, sending SIGKILL"; kill -KILL "$pid" 2>/dev/null; }
}

# The kubelet first, so it does not restart what is being killed.
# kill_listed LIST_COMMAND...: SIGKILL what the command lists, until it lists nothing (3 rounds).
kill_listed() {
  local pids
  for _ in 1 2 3; do
    pids=$("$@")
    [ -n "$pids" ] || return 0
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null
    sleep 0.3
  done
}
stop kubelet
kill_listed cgroup_pids
for d in kube-proxy coredns containerd kube-scheduler kube-controller-manager kube-apiserver etcd; do stop "$d"; done
kill_listed ns_pids "$RUN"
stop holder
# Children of the holder (it exec'd sleep under unshare --fork): wait until nothing is left.
for _ in $(seq 50); do [ -z "$(ns_pids "$RUN")" ] && break; sleep 0.1; done
left=$(ns_pids "$RUN"); [ -z "$left" ] || log "still running in the node's namespaces: $left"

# Remove cgroups deepest first; a directory whose tasks just died can take a moment to empty.
for _ in $(seq 20); do
  dirs=$(node_cgroups)
  [ -n "$dirs" ] || break
  for d in $dirs; do find "$d" -depth -type d -exec rmdir {} + 2>/dev/null; done
  sleep 0.2
done
[ -z "$(node_cgroups)" ] || log "cgroups left: $(node_cgroups | tr '\n' ' ')"
rm -rf "$RUN/pki"
log "node stopped ($RUN)"
