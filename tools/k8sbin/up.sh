#!/usr/bin/env bash
# Start a throw-away control plane (etcd + kube-apiserver, no kubelet/controller-manager)
# as local processes, envtest-style, listening on free 127.0.0.1 ports only.
#
#   tools/k8sbin/up.sh RUN_DIR        # then: export KUBECONFIG=RUN_DIR/kubeconfig
#   tools/k8sbin/down.sh RUN_DIR
#
# Writes into RUN_DIR:
#   pki/            ca.{crt,key}, apiserver.{crt,key} (SAN IP:127.0.0.1, DNS:localhost),
#                   admin.{crt,key} (CN=admin, O=system:masters), sa.{key,pub},
#                   webhook.{crt,key} (serverAuth, SAN IP:127.0.0.1, DNS:localhost; for
#                   webhook servers under test, trusted via caBundle=ca.crt)
#   kubeconfig      cluster/user/context "tollgate-e2e", certs embedded
#   env             shell-sourceable: KUBECONFIG, K8S_API_URL, K8SBIN_DIR, HELM_*_HOME, ports
#   etcd.pid, kube-apiserver.pid, etcd.log, kube-apiserver.log, etcd-data/
#
# Env: K8SBIN_DIR (binaries; default: output of build.sh), K8SBIN_START_TIMEOUT (s, default 90),
#      K8SBIN_APISERVER_ARGS (extra kube-apiserver flags, word-split).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
RUN=${1:?usage: up.sh RUN_DIR}
mkdir -p "$RUN"; RUN=$(cd "$RUN" && pwd)
TIMEOUT=${K8SBIN_START_TIMEOUT:-90}
log() { printf '[k8sbin] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
for t in openssl curl python3 setsid; do command -v $t >/dev/null || die "$t not found"; done

for f in "$RUN"/*.pid; do
  [ -e "$f" ] || continue
  if tr '\0' ' ' < "/proc/$(cat "$f")/cmdline" 2>/dev/null | grep -qF "$RUN/"; then die "$f is alive; run down.sh $RUN first"; fi
  rm -f "$f"
done

if [ -z "${K8SBIN_DIR:-}" ]; then
  BIN=$("$HERE/build.sh") || die "build.sh failed"
  BIN=${BIN##*$'\n'}
else
  BIN=$K8SBIN_DIR
fi
for b in etcd kube-apiserver; do [ -x "$BIN/$b" ] || die "$BIN/$b missing (run build.sh)"; done

# On any failure, stop what was started so nothing is left behind.
ok=0
trap '[ $ok = 1 ] || { log "start-up failed, cleaning up"; "$HERE/down.sh" "$RUN" >&2 || true; }' EXIT

# ---------------------------------------------------------------- PKI
P="$RUN/pki"; rm -rf "$P"; mkdir -p "$P"; chmod 700 "$P"
(
  cd "$P"
  exec >/dev/null 2>&1
  openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 3650 \
    -subj "/CN=tollgate-e2e-ca" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
  leaf() { # name subject extensions
    openssl req -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.csr" -subj "$2"
    printf '%b' "$3" > "$1.ext"
    openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 \
      -extfile "$1.ext" -out "$1.crt"
    rm -f "$1.csr" "$1.ext"
  }
  SRV='basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n'
  leaf apiserver "/CN=kube-apiserver" "$SRV"
  leaf webhook "/CN=localhost" "$SRV"
  leaf admin "/O=system:masters/CN=admin" \
    'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n'
  openssl genrsa -out sa.key 2048
  openssl rsa -in sa.key -pubout -out sa.pub
) || die "openssl failed"

# ---------------------------------------------------------------- ports
# Bind port 0 three times (sockets held open together so the ports differ).
read -r ETCD_PORT PEER_PORT API_PORT < <(python3 - <<'PY'
import socket
ss = [socket.socket() for _ in range(3)]
for s in ss: s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in ss])
PY
)

# start NAME CMD...: run detached (own session, stdin closed), log to RUN/NAME.log,
# the PID written is the exec'd binary itself.
start() {
  local name=$1; shift
  setsid bash -c 'echo $$ > "$0"; exec "$@"' "$RUN/$name.pid" "$@" \
    </dev/null >"$RUN/$name.log" 2>&1 &
  for _ in $(seq 50); do [ -s "$RUN/$name.pid" ] && return; sleep 0.1; done
  die "$name did not start"
}
# running PID: exists and is not a zombie (a dead child stays a zombie until reaped).
running() { [ -r "/proc/$1/stat" ] && [ "$(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null)" != Z ]; }
alive() { running "$(cat "$RUN/$1.pid")"; }
deadline=$((SECONDS + TIMEOUT))

# ---------------------------------------------------------------- etcd
rm -rf "$RUN/etcd-data"
ETCD_URL="http://127.0.0.1:$ETCD_PORT"
start etcd "$BIN/etcd" --name default --data-dir "$RUN/etcd-data" \
  --listen-client-urls "$ETCD_URL" --advertise-client-urls "$ETCD_URL" \
  --listen-peer-urls "http://127.0.0.1:$PEER_PORT" \
  --initial-advertise-peer-urls "http://127.0.0.1:$PEER_PORT" \
  --initial-cluster "default=http://127.0.0.1:$PEER_PORT" \
  --unsafe-no-fsync --log-level warn
until curl -fsS -m 2 "$ETCD_URL/health" >/dev/null 2>&1; do
  alive etcd || { tail -n 30 "$RUN/etcd.log" >&2; die "etcd exited"; }
  [ $SECONDS -lt $deadline ] || { tail -n 30 "$RUN/etcd.log" >&2; die "etcd not healthy after ${TIMEOUT}s"; }
  sleep 0.2
done
log "etcd healthy on $ETCD_URL"

# ---------------------------------------------------------------- kube-apiserver
API_URL="https://127.0.0.1:$API_PORT"
# --advertise-address=127.0.0.1 + --endpoint-reconciler-type=none: no dependence on the
#   host's routes; the loopback address would be rejected in the kubernetes Endpoints.
# --disable-admission-plugins=ServiceAccount: without kube-controller-manager no
#   "default" ServiceAccount exists, and the plugin would reject every Pod create.
# Mutating/ValidatingAdmissionWebhook (and ValidatingAdmissionPolicy) are on by default;
#   they are listed explicitly to make that visible.
# shellcheck disable=SC2086
start kube-apiserver "$BIN/kube-apiserver" \
  --etcd-servers="$ETCD_URL" \
  --bind-address=127.0.0.1 --secure-port="$API_PORT" \
  --advertise-address=127.0.0.1 --endpoint-reconciler-type=none \
  --tls-cert-file="$P/apiserver.crt" --tls-private-key-file="$P/apiserver.key" \
  --client-ca-file="$P/ca.crt" \
  --service-account-issuer="$API_URL" \
  --service-account-key-file="$P/sa.pub" --service-account-signing-key-file="$P/sa.key" \
  --service-cluster-ip-range=10.0.0.0/24 \
  --authorization-mode=RBAC --allow-privileged=true \
  --enable-admission-plugins=MutatingAdmissionWebhook,ValidatingAdmissionWebhook \
  --disable-admission-plugins=ServiceAccount \
  ${K8SBIN_APISERVER_ARGS:-}

CURL=(curl -fsS -m 5 --cacert "$P/ca.crt" --cert "$P/admin.crt" --key "$P/admin.key")
until "${CURL[@]}" "$API_URL/readyz" >/dev/null 2>&1 \
   && "${CURL[@]}" "$API_URL/api/v1/namespaces/default" >/dev/null 2>&1; do
  alive kube-apiserver || { tail -n 40 "$RUN/kube-apiserver.log" >&2; die "kube-apiserver exited"; }
  [ $SECONDS -lt $deadline ] || { tail -n 40 "$RUN/kube-apiserver.log" >&2; die "kube-apiserver not ready after ${TIMEOUT}s"; }
  sleep 0.5
done

# ---------------------------------------------------------------- kubeconfig + env
b64() { base64 -w0 < "$1"; }
cat > "$RUN/kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters:
- name: tollgate-e2e
  cluster:
    server: $API_URL
    certificate-authority-data: $(b64 "$P/ca.crt")
users:
- name: admin
  user:
    client-certificate-data: $(b64 "$P/admin.crt")
    client-key-data: $(b64 "$P/admin.key")
contexts:
- name: tollgate-e2e
  context:
    cluster: tollgate-e2e
    user: admin
    namespace: default
current-context: tollgate-e2e
KC
chmod 600 "$RUN/kubeconfig"
mkdir -p "$RUN/helm/cache" "$RUN/helm/config" "$RUN/helm/data"
cat > "$RUN/env" <<ENV
export KUBECONFIG='$RUN/kubeconfig'
export K8S_API_URL='$API_URL'
export K8S_CA_FILE='$P/ca.crt'
export K8SBIN_DIR='$BIN'
export ETCD_URL='$ETCD_URL'
export HELM_CACHE_HOME='$RUN/helm/cache' HELM_CONFIG_HOME='$RUN/helm/config' HELM_DATA_HOME='$RUN/helm/data'
ENV
ok=1
log "kube-apiserver ready on $API_URL after ${SECONDS}s (pids: etcd $(cat "$RUN/etcd.pid"), kube-apiserver $(cat "$RUN/kube-apiserver.pid"))"
log "use: export KUBECONFIG=$RUN/kubeconfig   (or: . $RUN/env)"
echo "$RUN/kubeconfig"
