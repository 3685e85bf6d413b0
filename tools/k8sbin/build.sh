#!/usr/bin/env bash
# Build the Kubernetes binaries the tests run (kube-apiserver, etcd and helm for the control
# plane; kubelet, kube-scheduler, kube-controller-manager, kube-proxy and CoreDNS for the real
# node) from the Go module proxy (no release downloads) into
# <repo>/.cache/k8sbin/<k8s>-<etcd>-<helm>-<coredns>/ and print that directory as the last line
# on stdout. Everything else goes to stderr. Binaries already present are reused.
#
# Env: K8SBIN_CACHE (default <repo>/.cache/k8sbin), K8SBIN_NICE (default 19).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# shellcheck source=versions.env
. "$HERE/versions.env"

log() { printf '[k8sbin] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

command -v go >/dev/null || die "go not found in PATH"
export CGO_ENABLED=0 GOTOOLCHAIN=local
# go.sum files are checked in: build in the default -mod=readonly mode so that a build
# never silently changes the dependency graph. -buildvcs=false: the builder modules
# live inside the project's git tree, whose state is irrelevant to these binaries.
export GOFLAGS="-buildvcs=false"
NICE=(nice -n "${K8SBIN_NICE:-19}")

# Check that versions.env agrees with the builder modules.
modver() { (cd "$HERE/$1" && go list -m -f '{{.Version}}' "$2"); }
[ "$(modver apiserver k8s.io/kubernetes)" = "$K8S_VERSION" ] || die "apiserver/go.mod is not at $K8S_VERSION (run apiserver/sync.sh $K8S_VERSION)"
[ "$(modver etcd go.etcd.io/etcd/server/v3)" = "$ETCD_VERSION" ] || die "etcd/go.mod is not at $ETCD_VERSION"
[ "$(modver helm helm.sh/helm/v3)" = "$HELM_VERSION" ] || die "helm/go.mod is not at $HELM_VERSION"
[ "$(modver coredns github.com/coredns/coredns)" = "$COREDNS_VERSION" ] || die "coredns/go.mod is not at $COREDNS_VERSION"
[ "$(modver prometheus github.com/prometheus/prometheus)" = "$PROMETHEUS_VERSION" ] || die "prometheus/go.mod is not at $PROMETHEUS_VERSION"

CACHE=${K8SBIN_CACHE:-$ROOT/.cache/k8sbin}
OUT="$CACHE/$K8S_VERSION-$ETCD_VERSION-$HELM_VERSION-$COREDNS_VERSION"
mkdir -p "$OUT"
# Serialise concurrent build.sh runs on the same output directory.
exec 9>"$OUT/.lock"
flock 9

# build <name> <module dir> <package> <ldflags> [go build flags...]
build() {
  local name=$1 dir=$2 pkg=$3 ldflags=$4
  shift 4
  if [ -x "$OUT/$name" ]; then log "$name: cached"; return; fi
  log "$name: downloading modules ($dir)"
  local t0=$SECONDS
  (cd "$HERE/$dir" && "${NICE[@]}" go mod download) >&2
  local t1=$SECONDS
  log "$name: building $pkg (nice, this can take a while)"
  (cd "$HERE/$dir" && "${NICE[@]}" go build -trimpath -pgo=off "$@" -ldflags "$ldflags" -o "$OUT/$name.tmp" "$pkg") >&2
  mv -f "$OUT/$name.tmp" "$OUT/$name"
  log "$name: done, download $((t1 - t0))s, build $((SECONDS - t1))s, $(stat -c %s "$OUT/$name") bytes"
}

# kube-apiserver: stamp the version like hack/lib/version.sh does, so /version (and
# therefore kubectl, helm's .Capabilities.KubeVersion, kube-rs) see the real version.
# buildDate is the module's publication time, so the binary is reproducible.
K8S_MINOR=${K8S_VERSION#v1.}; K8S_MINOR=${K8S_MINOR%%.*}
K8S_DATE=$(cd "$HERE/apiserver" && go list -m -f '{{.Time.UTC.Format "2006-01-02T15:04:05Z"}}' k8s.io/kubernetes)
KV=""
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  KV+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$K8S_MINOR"
  KV+=" -X $p.gitTreeState=clean -X $p.buildDate=$K8S_DATE"
done
build kube-apiserver apiserver k8s.io/kubernetes/cmd/kube-apiserver "-s -w$KV"
# The node's binaries come from the same module graph (tool lines in apiserver/go.mod), so
# they share the build cache with kube-apiserver and cost a minute or two each after it.
for b in kubelet kube-scheduler kube-controller-manager kube-proxy; do
  build "$b" apiserver "k8s.io/kubernetes/cmd/$b" "-s -w$KV"
done

# etcd: the server module's root package is the etcd main; its version is a constant.
build etcd etcd go.etcd.io/etcd/server/v3 "-s -w"

# helm: same ldflags as helm's Makefile.
HK=$(modver helm k8s.io/client-go); HK=${HK#v}
HK_MAJOR=$(( ${HK%%.*} + 1 )); HK_MINOR=$(echo "$HK" | cut -d. -f2)
HV="-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
for p in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
  HV+=" -X $p.k8sVersionMajor=$HK_MAJOR -X $p.k8sVersionMinor=$HK_MINOR"
done
build helm helm helm.sh/helm/v3/cmd/helm "-s -w $HV"

# CoreDNS with the plugins a cluster's DNS needs (coredns/main.go).
build coredns coredns example.invalid/tollgate/k8sbin/coredns "-s -w"

# Prometheus and promtool for the alert tests. The directory name above predates them, so
# they live in a versioned subdirectory: a bump rebuilds these two and nothing else.
# remove_all_sd drops the cloud service discoveries (the tests use static targets); the web
# UI's assets are not embedded (the tests use the HTTP API only).
PROM_OUT="prometheus-$PROMETHEUS_VERSION"
mkdir -p "$OUT/$PROM_OUT"
# The Go module v0.316.0 is Prometheus 3.16.0.
PM=${PROMETHEUS_VERSION#v0.}; PM_PATCH=${PM#*.}; PM=${PM%%.*}
PV="-X github.com/prometheus/common/version.Version=${PM:0:1}.${PM:1}.$PM_PATCH -X github.com/prometheus/common/version.Branch=module"
build "$PROM_OUT/prometheus" prometheus github.com/prometheus/prometheus/cmd/prometheus "-s -w $PV" -tags remove_all_sd
build "$PROM_OUT/promtool" prometheus github.com/prometheus/prometheus/cmd/promtool "-s -w $PV" -tags remove_all_sd
ln -sfn "$PROM_OUT/prometheus" "$OUT/prometheus"
ln -sfn "$PROM_OUT/promtool" "$OUT/promtool"

log "versions:"
"$OUT/kube-apiserver" --version >&2
"$OUT/etcd" --version 2>&1 | sed -n 1p >&2   # not head: SIGPIPE + pipefail would fail the build
"$OUT/helm" version --short >&2
"$OUT/kubelet" --version >&2
"$OUT/coredns" -version 2>&1 | sed -n 1p >&2
"$OUT/prometheus" --version 2>&1 | sed -n 1p >&2
echo "$OUT"
