#!/usr/bin/env bash
# End-to-end smoke test of the local control plane with the project's CRD:
# build (cached) -> up.sh -> kubectl/helm checks -> down.sh. Needs kubectl on PATH.
#   tools/k8sbin/smoke.sh [RUN_DIR]     (default: a fresh mktemp dir, removed afterwards)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
RUN=${1:-$(mktemp -d /tmp/tollgate-k8s.XXXXXX)}
trap '"$HERE/down.sh" "$RUN"; [ -n "${1:-}" ] || rm -rf "$RUN"' EXIT
step() { printf '\n### %s\n' "$*" >&2; }
fail() { printf 'SMOKE FAILED: %s\n' "$*" >&2; exit 1; }

"$HERE/up.sh" "$RUN" >/dev/null
# shellcheck disable=SC1091
. "$RUN/env"

step "kubectl version / get ns"
kubectl version 2>/dev/null | grep -q "^Server Version: $(. "$HERE/versions.env"; echo "$K8S_VERSION")\$" || fail "server version"
kubectl get ns default kube-system >&2

step "CRD"
kubectl apply -f "$ROOT/manifests/crds/tollgate.dev_ratelimitpolicies.yaml" >&2
kubectl wait --for=condition=Established --timeout=60s crd/ratelimitpolicies.tollgate.dev >&2

step "example policies"
kubectl create namespace shop >&2
for f in "$ROOT"/manifests/examples/*.yaml; do kubectl apply -f "$f" >&2; done
kubectl get rlp -A >&2

step "invalid policies are rejected by the API server"
reject() { # name limit-json expected-substring
  local out
  if out=$(kubectl apply -f - 2>&1 <<JSON
{"apiVersion":"tollgate.dev/v1alpha1","kind":"RateLimitPolicy","metadata":{"name":"$1","namespace":"shop"},
 "spec":{"targetRef":{"selector":{}},"rules":[{"name":"r1","key":[{"header":"x-api-key"}],"limit":$2}]}}
JSON
  ); then fail "$1 was accepted"; fi
  printf '%s\n' "$out" >&2
  grep -qF -- "$3" <<<"$out" || fail "$1: expected '$3'"
}
reject period-2d '{"requests":100,"period":"2d"}' "should match '^([0-9]{1,9}(ms|s|m|h))+\$'"
reject period-25h '{"requests":100,"period":"25h"}' 'spec.rules[].limit.period must be greater than 0 and at most 24h'
reject burst-fixed '{"requests":100,"period":"1m","burst":20,"algorithm":"FixedWindow"}' \
  'spec.rules[0].limit.burst: Invalid value: spec.rules[].limit.burst only applies to algorithm TokenBucket'

step "helm"
"$K8SBIN_DIR/helm" version >&2
"$K8SBIN_DIR/helm" list -A >&2

echo "smoke OK" >&2
