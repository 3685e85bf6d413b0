#!/usr/bin/env bash
# The real-node tests (tests/node, pytest) on a one-node cluster started by up.sh, and the proof
# that a run, also a failed one, leaves nothing behind on the host:
#   1. a start-up made to fail half-way (NODE_FAIL_AT=containerd) must clean up after itself;
#   2. the cluster starts, the tests run inside its namespaces, the cluster stops;
#   3. after each, leakcheck.sh finds no mount, interface, cgroup or process left over.
# Env: K8SBIN_DIR, IMAGES_DIR (see up.sh), PYTEST_ARGS (extra pytest arguments).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
log() { printf '\n==> [node] %s\n' "$*" >&2; }
WORK=$(mktemp -d /tmp/tollgate-node.XXXXXX)
status=0

log "a failed start-up cleans up after itself"
"$HERE/leakcheck.sh" snapshot "$WORK/before"
if NODE_FAIL_AT=containerd "$HERE/up.sh" "$WORK/failed" 2>"$WORK/failed.log"; then
  echo "up.sh with NODE_FAIL_AT=containerd succeeded; it must fail" >&2; status=1
fi
grep -q 'NODE_FAIL_AT=containerd' "$WORK/failed.log" || { cat "$WORK/failed.log" >&2; echo "up.sh failed before its fail point" >&2; status=1; }
"$HERE/leakcheck.sh" compare "$WORK/before" "$WORK/failed" || status=1

log "start the node"
RUN="$WORK/run"
t0=$SECONDS
if "$HERE/up.sh" "$RUN"; then
  log "node up in $((SECONDS - t0))s; tests/node"
  # shellcheck disable=SC2086
  "$HERE/exec.sh" "$RUN" python3 -m pytest -p no:cacheprovider -v -s -x "$ROOT/tests/node" ${PYTEST_ARGS:-} || status=1
else
  status=1
fi
[ $status = 0 ] || { for f in "$RUN"/logs/*.log; do [ -f "$f" ] && { echo "--- $f (last 20 lines)"; tail -n 20 "$f"; }; done >&2; }
"$HERE/down.sh" "$RUN"
"$HERE/leakcheck.sh" compare "$WORK/before" "$RUN" || status=1
[ $status = 0 ] && rm -rf "$WORK" || log "logs kept in $WORK"
exit $status
