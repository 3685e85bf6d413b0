#!/usr/bin/env bash
# Start a one-node Kubernetes cluster with real pods, inside a private mount and network
# namespace, so nothing it does touches the host's sysctls, mounts or interfaces:
#
#   tools/node/up.sh RUN_DIR        # then: tools/node/exec.sh RUN_DIR kubectl get pods -A
#   tools/node/down.sh RUN_DIR      # stops everything by PID, removes the cgroups it made
#
# Inside the namespaces: etcd, kube-apiserver (ServiceAccount admission, TokenRequest, Node and
# RBAC authorization, NodeRestriction), kube-controller-manager, kube-scheduler, containerd +
# runc, kubelet, kube-proxy (iptables mode, the real Service VIPs) and CoreDNS (cluster DNS at
# 10.99.0.1), all from tools/k8sbin and Debian packages. The node's address is 10.99.0.1 on a veth
# pair that exists only in the namespace; pods get 10.88.0.0/16 from the CNI bridge plugin; the
# Service range is 10.0.0.0/24. Images come from the archives of tools/images/build.sh, imported
# into containerd (nothing is pulled).
#
# Writes RUN_DIR/env (KUBECONFIG etc.; use it through exec.sh, which enters the namespaces).
# Env: K8SBIN_DIR (default: output of tools/k8sbin/build.sh), IMAGES_DIR (default .cache/images),
#      NODE_START_TIMEOUT (s, default 120), NODE_FAIL_AT (test hook: fail after that step).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
RUN=${1:?usage: up.sh RUN_DIR}
mkdir -p "$RUN"; RUN=$(cd "$RUN" && pwd)
TIMEOUT=${NODE_START_TIMEOUT:-120}
IMAGES=${IMAGES_DIR:-$ROOT/.cache/images}
NODE=tg-node NODE_IP=10.99.0.1 POD_CIDR=10.88.0.0/16 SVC_CIDR=10.0.0.0/24 API_SVC_IP=10.0.0.1
log() { printf '[node] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
# shellcheck source=lib.sh
. "$HERE/lib.sh"

for t in containerd ctr runc iptables-restore conntrack unshare nsenter openssl curl; do
  command -v "$t" >/dev/null || die "$t not found: tools/test-all.sh installs containerd, runc, iptables, conntrack and containernetworking-plugins from Debian"
done
[ -x /usr/lib/cni/bridge ] && [ -x /usr/lib/cni/host-local ] && [ -x /usr/lib/cni/loopback ] \
  || die "CNI plugins missing in /usr/lib/cni: apt-get install containernetworking-plugins (tools/test-all.sh does)"
if [ -z "${K8SBIN_DIR:-}" ]; then
  K8SBIN_DIR=$("$ROOT/tools/k8sbin/build.sh" | tail -n 1) || die "tools/k8sbin/build.sh failed"
fi
BIN=$K8SBIN_DIR
for b in etcd kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy coredns; do
  [ -x "$BIN/$b" ] || die "$BIN/$b missing: run tools/k8sbin/build.sh (tools/test-all.sh does)"
done
for i in pause; do [ -s "$IMAGES/$i.tar" ] || die "$IMAGES/$i.tar missing: run tools/images/build.sh"; done
[ ! -s "$RUN/holder.pid" ] || ! running "$(cat "$RUN/holder.pid")" || die "$RUN is in use; run down.sh $RUN first"

ok=0
trap '[ $ok = 1 ] || { log "start-up failed, stopping what was started"; "$HERE/down.sh" "$RUN" >&2 || true; }' EXIT
failpoint() { [ "${NODE_FAIL_AT:-}" != "$1" ] || die "NODE_FAIL_AT=$1 (test hook)"; }
deadline=$((SECONDS + TIMEOUT))
wait_for() { # what command...
  local what=$1; shift
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || die "$what not ready after ${TIMEOUT}s (logs in $RUN)"
    sleep 0.3
  done
}

# ------------------------------------------------------------ namespaces
# The holder keeps the namespaces alive; everything else enters them with nsenter.
rm -f "$RUN/holder.pid"
setsid unshare --mount --net --propagation private --fork -- \
  bash -c 'echo $$ > "$0"; exec sleep infinity' "$RUN/holder.pid" </dev/null >/dev/null 2>&1 &
for _ in $(seq 50); do [ -s "$RUN/holder.pid" ] && break; sleep 0.1; done
[ -s "$RUN/holder.pid" ] || die "unshare did not start"
HOLDER=$(cat "$RUN/holder.pid")
readlink "/proc/$HOLDER/ns/net" > "$RUN/netns"
readlink "/proc/$HOLDER/ns/mnt" > "$RUN/mntns"
ns() { nsenter -t "$HOLDER" -m -n -- "$@"; }

# Fixed host paths the kubelet, containerd and CNI use get private tmpfs mounts; the sysctls the
# kubelet checks (protectKernelDefaults) get bind-mounted files with its values, so the host's
# are never written.
mkdir -p "$RUN/sysctl" "$RUN/logs"
ns mount -t tmpfs -o mode=755 tmpfs /run
ns mount -t tmpfs -o mode=755 tmpfs /var/lib
ns mount -t tmpfs -o mode=755 tmpfs /var/log
for kv in vm/overcommit_memory=1 vm/panic_on_oom=0 kernel/panic=10 kernel/panic_on_oops=1 \
          kernel/keys/root_maxkeys=1000000 kernel/keys/root_maxbytes=25000000; do
  k=${kv%%=*} v=${kv#*=}
  [ "$(cat "/proc/sys/$k")" = "$v" ] && continue
  f="$RUN/sysctl/${k//\//.}"; echo "$v" > "$f"
  ns mount --bind "$f" "/proc/sys/$k"
done
ns ip link set lo up
ns ip link add tg-node0 type veth peer name tg-node1
ns ip addr add "$NODE_IP/24" dev tg-node0
ns ip link set tg-node0 up
ns ip link set tg-node1 up
# Locally started clients (the tests) reach Service VIPs: a route makes the kernel pick a source
# address before kube-proxy's OUTPUT rules DNAT the packet.
ns ip route add "$SVC_CIDR" dev tg-node0 src "$NODE_IP"
# Namespace-local network settings (this network namespace's own copies).
ns sh -c 'echo 1 > /proc/sys/net/ipv4/ip_forward; echo 1 > /proc/sys/net/ipv4/conf/all/route_localnet'
failpoint namespaces

# ------------------------------------------------------------ PKI
P="$RUN/pki"; rm -rf "$P"; mkdir -p "$P"; chmod 700 "$P"
(
  cd "$P"; exec >/dev/null 2>&1
  openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 3650 -subj "/CN=tollgate-node-ca" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
  leaf() { # name subject extensions
    openssl req -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.csr" -subj "$2"
    printf '%b' "$3" > "$1.ext"
    openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 -extfile "$1.ext" -out "$1.crt"
    rm -f "$1.csr" "$1.ext"
  }
  CLIENT='basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n'
  leaf apiserver "/CN=kube-apiserver" "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,IP:$NODE_IP,IP:$API_SVC_IP,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\n"
  leaf kubelet-serving "/CN=$NODE" "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\nsubjectAltName=IP:$NODE_IP,DNS:$NODE\n"
  leaf admin "/O=system:masters/CN=admin" "$CLIENT"
  leaf apiserver-kubelet "/O=system:masters/CN=kube-apiserver-kubelet-client" "$CLIENT"
  leaf node "/O=system:nodes/CN=system:node:$NODE" "$CLIENT"
  leaf kcm "/CN=system:kube-controller-manager" "$CLIENT"
  leaf scheduler "/CN=system:kube-scheduler" "$CLIENT"
  leaf proxy "/CN=system:kube-proxy" "$CLIENT"
  leaf coredns "/CN=tollgate:coredns" "$CLIENT"
  openssl genrsa -out sa.key 2048
  openssl rsa -in sa.key -pubout -out sa.pub
) || die "openssl failed"
API_URL="https://$NODE_IP:6443"
kubeconfig() { # name cert
  cat > "$RUN/$1.kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters: [{name: node, cluster: {server: "$API_URL", certificate-authority: "$P/ca.crt"}}]
users: [{name: $2, user: {client-certificate: "$P/$2.crt", client-key: "$P/$2.key"}}]
contexts: [{name: node, context: {cluster: node, user: $2, namespace: default}}]
current-context: node
KC
  chmod 600 "$RUN/$1.kubeconfig"
}
for k in admin node kcm scheduler proxy coredns; do kubeconfig "$k" "$k"; done

# ------------------------------------------------------------ control plane
start() { # name command... (inside the namespaces; the pid file holds the daemon's own pid)
  local name=$1; shift
  rm -f "$RUN/$name.pid"
  ns setsid bash -c 'echo $$ > "$0"; exec "$@"' "$RUN/$name.pid" "$@" </dev/null >"$RUN/logs/$name.log" 2>&1 &
  for _ in $(seq 50); do [ -s "$RUN/$name.pid" ] && return; sleep 0.1; done
  die "$name did not start"
}
alive_or_die() { running "$(cat "$RUN/$1.pid")" || { tail -n 30 "$RUN/logs/$1.log" >&2; die "$1 exited"; }; }

start etcd "$BIN/etcd" --name node --data-dir /var/lib/etcd --listen-client-urls http://127.0.0.1:2379 \
  --advertise-client-urls http://127.0.0.1:2379 --listen-peer-urls http://127.0.0.1:2380 \
  --initial-advertise-peer-urls http://127.0.0.1:2380 --initial-cluster node=http://127.0.0.1:2380 \
  --unsafe-no-fsync --log-level warn
wait_for etcd ns curl -fsS -m 2 http://127.0.0.1:2379/health
start kube-apiserver "$BIN/kube-apiserver" --etcd-servers=http://127.0.0.1:2379 \
  --bind-address=0.0.0.0 --secure-port=6443 --advertise-address="$NODE_IP" \
  --tls-cert-file="$P/apiserver.crt" --tls-private-key-file="$P/apiserver.key" --client-ca-file="$P/ca.crt" \
  --kubelet-client-certificate="$P/apiserver-kubelet.crt" --kubelet-client-key="$P/apiserver-kubelet.key" \
  --kubelet-preferred-address-types=InternalIP \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --service-account-key-file="$P/sa.pub" --service-account-signing-key-file="$P/sa.key" \
  --service-cluster-ip-range="$SVC_CIDR" --authorization-mode=Node,RBAC --allow-privileged=true \
  --enable-admission-plugins=NodeRestriction,ServiceAccount,MutatingAdmissionWebhook,ValidatingAdmissionWebhook
A=(curl -fsS -m 5 --cacert "$P/ca.crt" --cert "$P/admin.crt" --key "$P/admin.key")
wait_for kube-apiserver ns "${A[@]}" "$API_URL/readyz"
alive_or_die kube-apiserver
failpoint apiserver
start kube-controller-manager "$BIN/kube-controller-manager" --kubeconfig="$RUN/kcm.kubeconfig" \
  --authentication-kubeconfig="$RUN/kcm.kubeconfig" --authorization-kubeconfig="$RUN/kcm.kubeconfig" \
  --bind-address=127.0.0.1 --secure-port=10257 --leader-elect=false --use-service-account-credentials \
  --service-account-private-key-file="$P/sa.key" --root-ca-file="$P/ca.crt" \
  --cluster-signing-cert-file="$P/ca.crt" --cluster-signing-key-file="$P/ca.key" \
  --node-monitor-grace-period=20s
start kube-scheduler "$BIN/kube-scheduler" --kubeconfig="$RUN/scheduler.kubeconfig" \
  --authentication-kubeconfig="$RUN/scheduler.kubeconfig" --authorization-kubeconfig="$RUN/scheduler.kubeconfig" \
  --bind-address=127.0.0.1 --secure-port=10259 --leader-elect=false

# ------------------------------------------------------------ containerd
mkdir -p "$RUN/cni"
cat > "$RUN/cni/10-tollgate.conflist" <<CNI
{"cniVersion": "1.0.0", "name": "tollgate-node", "plugins": [
  {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR"}]], "routes": [{"dst": "0.0.0.0/0"}]}}]}
CNI
cat > "$RUN/containerd.toml" <<TOML
version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "/run/containerd/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "tollgate.test/pause:1"
  # This VM lacks CAP_SYS_RESOURCE: runc cannot lower oom_score_adj below its own.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "/usr/sbin/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$RUN/cni"
TOML
start containerd containerd --config "$RUN/containerd.toml"
CTR=(ctr --address /run/containerd/containerd.sock -n k8s.io)
wait_for containerd ns "${CTR[@]}" version
for tar in "$IMAGES"/*.tar; do
  ns "${CTR[@]}" images import --no-unpack=false "$tar" >/dev/null || die "ctr import $tar failed"
done
log "images: $(ns "${CTR[@]}" images ls -q | grep -v '^sha256:' | tr '\n' ' ')"
failpoint containerd

# ------------------------------------------------------------ kubelet
: > "$RUN/resolv.conf"
cat > "$RUN/kubelet.yaml" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: "$P/ca.crt"}
authorization: {mode: Webhook}
tlsCertFile: "$P/kubelet-serving.crt"
tlsPrivateKeyFile: "$P/kubelet-serving.key"
address: "$NODE_IP"
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
# cgroup v1 hierarchies on this VM, no systemd.
failCgroupV1: false
cgroupDriver: cgroupfs
# Check, never write, the kernel tunables (they are bind-mounted in the namespace).
protectKernelDefaults: true
failSwapOn: false
clusterDNS: ["$NODE_IP"]
clusterDomain: cluster.local
resolvConf: "$RUN/resolv.conf"
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
syncFrequency: 10s
fileCheckFrequency: 10s
nodeStatusReportFrequency: 10s
YAML
start kubelet "$BIN/kubelet" --config="$RUN/kubelet.yaml" --kubeconfig="$RUN/node.kubeconfig" \
  --hostname-override="$NODE" --node-ip="$NODE_IP" --root-dir=/var/lib/kubelet --v=1
K=(env KUBECONFIG="$RUN/admin.kubeconfig" kubectl)
wait_for "node $NODE Ready" ns "${K[@]}" wait --for=condition=Ready "node/$NODE" --timeout=2s
alive_or_die kubelet
failpoint kubelet

# ------------------------------------------------------------ kube-proxy and CoreDNS
cat > "$RUN/kube-proxy.yaml" <<YAML
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clientConnection: {kubeconfig: "$RUN/proxy.kubeconfig"}
hostnameOverride: $NODE
clusterCIDR: $POD_CIDR
# Pod -> Service -> pod on the same bridge: SNAT so replies return through the DNAT.
iptables: {masqueradeAll: true}
# Leave the (host-global) conntrack table settings alone.
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
YAML
start kube-proxy "$BIN/kube-proxy" --config="$RUN/kube-proxy.yaml"
wait_for kube-proxy ns curl -fsS -m 2 http://127.0.0.1:10256/healthz
# CoreDNS reads Services and EndpointSlices with a client certificate bound to the same
# ClusterRole a CoreDNS Deployment gets.
ns "${K[@]}" apply -f - >/dev/null <<'YAML'
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "tollgate:coredns"}
rules:
  - apiGroups: [""]
    resources: [endpoints, services, pods, namespaces]
    verbs: [list, watch]
  - apiGroups: [discovery.k8s.io]
    resources: [endpointslices]
    verbs: [list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "tollgate:coredns"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "tollgate:coredns"}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: User, name: "tollgate:coredns"}]
YAML
cat > "$RUN/Corefile" <<CF
.:53 {
    bind $NODE_IP
    errors
    health 127.0.0.1:8180
    ready 127.0.0.1:8181
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        kubeconfig $RUN/coredns.kubeconfig node
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }
    cache 5
}
CF
start coredns "$BIN/coredns" -conf "$RUN/Corefile"
wait_for coredns ns curl -fsS -m 2 http://127.0.0.1:8181/ready
wait_for "ServiceAccount default" ns "${K[@]}" get serviceaccount default -n default
failpoint dns

cat > "$RUN/env" <<ENV
export KUBECONFIG='$RUN/admin.kubeconfig'
export K8SBIN_DIR='$BIN' PATH="$BIN:$PATH"
export NODE_NAME='$NODE' NODE_IP='$NODE_IP' NODE_RUN='$RUN'
export HELM_CACHE_HOME='$RUN/helm/cache' HELM_CONFIG_HOME='$RUN/helm/config' HELM_DATA_HOME='$RUN/helm/data'
ENV
ok=1
log "node $NODE Ready after ${SECONDS}s; enter with: tools/node/exec.sh $RUN <command>"
