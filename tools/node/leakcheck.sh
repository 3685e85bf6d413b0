#!/usr/bin/env bash
# Proof that a node run left nothing behind on the host:
#   leakcheck.sh snapshot FILE            before up.sh
#   leakcheck.sh compare FILE RUN_DIR     after down.sh: fails listing any mount, interface,
#                                         cgroup or process that was not there before
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"
state() {
  echo "# mounts"; awk '{print $5}' /proc/self/mountinfo | sort
  echo "# interfaces"; ip -o link show | awk -F': ' '{print $2}' | sort
  echo "# cgroups"; find /sys/fs/cgroup -mindepth 1 -maxdepth 2 -type d | sort
}
case ${1:-} in
  snapshot) state > "${2:?file}" ;;
  compare)
    now=$(mktemp); state > "$now"
    leaked=$(diff "${2:?file}" "$now" | grep '^>' || true)
    run=$(cd "${3:?run dir}" && pwd)
    pids=$(ns_pids "$run"; pgrep -f -- "$run/" || true)
    rm -f "$now"
    if [ -n "$leaked$pids" ]; then
      echo "LEAK: the node run left these behind:" >&2
      [ -z "$leaked" ] || printf '%s\n' "$leaked" >&2
      [ -z "$pids" ] || echo "processes in the node's namespaces: $pids" >&2
      exit 1
    fi
    echo "leakcheck: nothing left behind" >&2 ;;
  *) echo "usage: leakcheck.sh snapshot FILE | compare FILE RUN_DIR" >&2; exit 2 ;;
esac
