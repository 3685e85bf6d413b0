#!/usr/bin/env bash
# Run a command inside the namespaces of the node started by up.sh RUN_DIR, with its env
# (KUBECONFIG, ...): tools/node/exec.sh RUN_DIR kubectl get pods -A
set -euo pipefail
RUN=$(cd "${1:?usage: exec.sh RUN_DIR COMMAND...}" && pwd); shift
# nsenter -m starts in /; the command runs in the caller's directory.
exec nsenter -t "$(cat "$RUN/holder.pid")" -m -n -- bash -c '. "$0/env"; cd "$1"; shift; exec "$@"' "$RUN" "$PWD" "$@"
