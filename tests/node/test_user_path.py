"""A platform engineer's path on a real node, in order: install the chart with the README's
commands, run an app with injected native sidecars, enforce per-key and global limits through
the Service, survive a sidecar crash and a controller failover, uninstall and install again
with the pods still running. Each test builds on the one before (pytest runs them in order)."""
import json
import os
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

from conftest import (APP_NS, RELEASE, ROOT, SYSTEM_NS, apply, eventually, get, helm, kjson,
                      kubectl, pods, ready, run)

APP = "shop-api"
REDIS_DEV = ["--set", "redis.dev.enabled=true", "--set", "redis.dev.image.repository=tollgate.test/redis",
             "--set-string", "redis.dev.image.tag=7"]
CONTROLLER = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=controller"


def readme_cluster_commands():
    """The commands of the README's "On a cluster" block, comments stripped."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    block = re.search(r"## On a cluster.*?```sh\n(.*?)```", text, re.S)
    assert block, "README.md has no 'On a cluster' sh block"
    return [line.split("#", 1)[0].strip() for line in block.group(1).splitlines() if line.strip()]


def app_deployment(replicas):
    return json.dumps({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": APP, "namespace": APP_NS},
        "spec": {
            "replicas": replicas, "selector": {"matchLabels": {"app": APP}},
            "template": {"metadata": {"labels": {"app": APP}}, "spec": {
                "terminationGracePeriodSeconds": 10,
                "containers": [{
                    "name": "app", "image": "tollgate.test/app:1", "imagePullPolicy": "Never",
                    # Loopback only: the sidecar is the pod's only way in.
                    "args": ["-p", "127.0.0.1:8080"],
                    "ports": [{"name": "http", "containerPort": 8080}],
                    "securityContext": {"runAsNonRoot": True, "readOnlyRootFilesystem": True,
                                        "allowPrivilegeEscalation": False},
                }]}}}})


APP_SERVICE = json.dumps({
    "apiVersion": "v1", "kind": "Service", "metadata": {"name": APP, "namespace": APP_NS},
    "spec": {"selector": {"app": APP}, "ports": [{"name": "http", "port": 80, "targetPort": "tollgate-http"}]}})


def service_ip(ns, name):
    return kjson("get", "service", "-n", ns, name)["spec"]["clusterIP"]


def app_targets():
    """(pod IP, sidecar port) of every app pod."""
    return [(p["status"]["podIP"], 8081) for p in pods(APP_NS, f"app={APP}")]


def app_pods_ready(n):
    def check():
        ps = [p for p in pods(APP_NS, f"app={APP}") if not p["metadata"].get("deletionTimestamp")]
        return ps if len(ps) == n and all(ready(p) for p in ps) else None
    return eventually(f"{n} {APP} pods Ready", check, timeout=120)


def sidecar_status(pod):
    return next(s for s in pod["status"]["initContainerStatuses"] if s["name"] == "tollgate-sidecar")


def check_notes(notes):
    """NOTES.txt names example files the chart ships and says what the product does."""
    shipped = sorted(os.listdir(os.path.join(ROOT, "charts/tollgate/examples")))
    assert "-f tollgate/examples/per-api-key.yaml" in notes, notes
    for f in shipped:
        assert f in notes, f"NOTES does not list {f}:\n{notes}"
    assert "raw.githubusercontent" not in notes, notes
    assert "share which sidecars" in notes and "counts only" not in notes, notes


def test_install_with_the_readme_commands():
    kubectl("create", "namespace", APP_NS)
    commands = readme_cluster_commands()
    assert commands[0].startswith("helm install tollgate charts/tollgate"), commands
    env = dict(os.environ, PATH=os.environ["K8SBIN_DIR"] + ":" + os.environ["PATH"])
    for cmd in commands:
        p = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
        assert p.returncode == 0, f"README command failed: {cmd}\n{p.stdout}\n{p.stderr}"
        if cmd.startswith("helm install"):
            check_notes(p.stdout)
    kubectl("wait", "--for=condition=Established", "crd/ratelimitpolicies.tollgate.dev", "--timeout=60s")
    # The dev Redis for global limits (README: `redis.dev.enabled=true`), before any app pod.
    helm("upgrade", RELEASE, os.path.join(ROOT, "charts/tollgate"), "-n", SYSTEM_NS, "--reuse-values", *REDIS_DEV)
    kubectl("-n", SYSTEM_NS, "rollout", "status", f"deployment/{RELEASE}-controller", "--timeout=180s")
    ctrl = eventually("2 controller pods Ready", lambda: (lambda ps: ps if len(ps) == 2 and all(map(ready, ps)) else None)(
        [p for p in pods(SYSTEM_NS, CONTROLLER) if not p["metadata"].get("deletionTimestamp")]), timeout=120)
    names = {p["metadata"]["name"] for p in ctrl}
    holder = eventually("a leader Lease held by a replica", lambda: kjson(
        "get", "lease", "-n", SYSTEM_NS, f"{RELEASE}-controller")["spec"].get("holderIdentity"), timeout=60)
    assert holder in names, (holder, names)
    for kind in ["mutatingwebhookconfiguration", "validatingwebhookconfiguration"]:
        cfgs = kjson("get", kind, "-l", f"app.kubernetes.io/instance={RELEASE}")["items"]
        assert cfgs and all(w["clientConfig"].get("caBundle") for c in cfgs for w in c["webhooks"]), kind
    eventually("dev Redis Ready", lambda: all(map(ready, pods(SYSTEM_NS, "app.kubernetes.io/component=redis"))) and
               pods(SYSTEM_NS, "app.kubernetes.io/component=redis"), timeout=120)


def injection_serves():
    """A server-side dry run of a pod in the labelled namespace comes back with the sidecar."""
    pod = json.loads(kubectl("run", "probe", "-n", APP_NS, "--image=tollgate.test/app:1", "--port=8080",
                             "--dry-run=server", "-o", "json").stdout)
    return any(c["name"] == "tollgate-sidecar" for c in pod["spec"].get("initContainers", []))


def test_app_pods_get_the_native_sidecar_and_turn_ready():
    # `helm install --wait` can return before kube-proxy routes the webhook Service; the
    # injection webhook fails open (failurePolicy Ignore), so a pod created then has no sidecar.
    eventually("the injection webhook answers through its Service", injection_serves, timeout=60, every=1)
    apply(app_deployment(3))
    apply(APP_SERVICE)
    ps = app_pods_ready(3)
    for p in ps:
        init = p["spec"]["initContainers"]
        side = next(c for c in init if c["name"] == "tollgate-sidecar")
        assert side.get("restartPolicy") == "Always", side
        # The app container started only after the sidecar was started (and its startup probe passed).
        s_started = sidecar_status(p)["state"]["running"]["startedAt"]
        app = next(c for c in p["status"]["containerStatuses"] if c["name"] == "app")
        assert app["state"]["running"]["startedAt"] >= s_started, (s_started, app)
        vols = {v["name"]: v for v in p["spec"]["volumes"]}
        token = vols["tollgate-token"]["projected"]["sources"][0]["serviceAccountToken"]
        assert token["audience"], token
    # The stream token the sidecar reads is the projected one, and the controller accepted it:
    # the rule stream is connected (metrics on the admin port, reached on the pod IP).
    for p in ps:
        ip = p["status"]["podIP"]
        eventually(f"{p['metadata']['name']} stream connected", lambda: b"tollgate_controller_connected 1" in
                   get(ip, 9091, "/metrics")[2], timeout=30)
        # The app is loopback-only: nothing answers on the pod IP's app port.
        try:
            get(ip, 8080, timeout=1)
            raise AssertionError("the app port is reachable from outside the pod")
        except OSError:
            pass


def test_cluster_dns_resolves_services_from_a_pod():
    pod = pods(APP_NS, f"app={APP}")[0]["metadata"]["name"]
    out = kubectl("exec", "-n", APP_NS, pod, "-c", "app", "--", "busybox", "nslookup",
                  f"{APP}.{APP_NS}.svc.cluster.local").stdout
    assert service_ip(APP_NS, APP) in out, out


def test_per_key_policy_answers_429_through_the_service():
    kubectl("wait", "-n", APP_NS, "rlp/shop-api-keys", "--for=condition=Programmed", "--timeout=60s")
    ip = service_ip(APP_NS, APP)
    statuses, last, started = [], None, time.monotonic()
    for _ in range(40):
        status, headers, body = get(ip, 80, headers={"x-api-key": "customer-1"})
        statuses.append(status)
        if status == 429:
            last = (headers, body)
    admitted, elapsed = statuses.count(200), time.monotonic() - started
    # Burst 20 plus the refill at 100/min while the loop ran, shared by the 3 pods through the
    # dev Redis. A brand-new key right after the policy is applied was seen to admit 23 in
    # 0.2 s (one extra token per sidecar from the first leases); the bound allows one per pod
    # until that is tightened (issue 17).
    refill = int(elapsed * 100 / 60) + 1
    assert 19 <= admitted <= 20 + 3 + refill, (statuses, elapsed)
    assert set(statuses) <= {200, 429}, statuses
    headers, body = last
    assert int(headers["retry-after"]) >= 1, headers
    assert "ratelimit-policy" in headers and "ratelimit" in headers, headers
    problem = json.loads(body)
    assert problem["status"] == 429 and "type" in problem, problem
    # Another key is not affected.
    assert get(ip, 80, headers={"x-api-key": "customer-2"})[0] == 200


GLOBAL_POLICY = """
apiVersion: tollgate.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: shop-global, namespace: shop}
spec:
  targetRef: {selector: {matchLabels: {app: shop-api}}}
  rules:
    - name: everyone
      match: {path: {prefix: /global}}
      limit: {requests: 300, period: 1h, algorithm: FixedWindow}
"""


def drive(targets, path, n, workers=8):
    """n requests spread over targets [(ip, port)], each with its own API key (so only the
    keyless global rule can reject them); returns the status counts."""
    def one(i):
        ip, port = targets[i % len(targets)]
        try:
            return get(ip, port, path, headers={"x-api-key": f"drive-{i}"})[0]
        except OSError as e:
            return f"error: {e}"
    with ThreadPoolExecutor(workers) as ex:
        res = list(ex.map(one, range(n)))
    return {s: res.count(s) for s in set(res)}


def in_sync(name, n):
    """The policy's current version is enforced by n sidecars (the Sidecars column): before
    that, a sidecar still on the previous rule set admits requests the new rule would count."""
    return kjson("get", "rlp", "-n", APP_NS, name).get("status", {}).get("sidecarsInSync") == n


def test_global_limit_holds_within_one_percent_across_pods():
    apply(GLOBAL_POLICY)
    kubectl("wait", "-n", APP_NS, "rlp/shop-global", "--for=condition=Programmed", "--timeout=60s")
    eventually("shop-global enforced by the 3 sidecars", lambda: in_sync("shop-global", 3), timeout=60)
    counts = drive(app_targets(), "/global/", 900)
    assert set(counts) <= {200, 429}, counts
    assert abs(counts.get(200, 0) - 300) <= 3, counts


def test_a_killed_sidecar_restarts_alone_and_traffic_resumes():
    pod = pods(APP_NS, f"app={APP}")[0]
    name, ip = pod["metadata"]["name"], pod["status"]["podIP"]
    cid = sidecar_status(pod)["containerID"].split("://", 1)[1]
    app_before = next(c for c in pod["status"]["containerStatuses"] if c["name"] == "app")
    run("ctr", "--address", "/run/containerd/containerd.sock", "-n", "k8s.io", "tasks", "kill", "-s", "SIGKILL", cid)
    killed = time.monotonic()
    # Traffic through that pod comes back within 2 s of the sidecar answering again.
    eventually("the pod answers again", lambda: get(ip, 8081, "/", headers={"x-api-key": "after-kill"}, timeout=1)[0] == 200,
               timeout=30, every=0.1)
    back = time.monotonic() - killed
    p = kjson("get", "pod", "-n", APP_NS, name)
    eventually("restartCount 1", lambda: sidecar_status(kjson("get", "pod", "-n", APP_NS, name))["restartCount"] == 1)
    app_after = next(c for c in p["status"]["containerStatuses"] if c["name"] == "app")
    assert app_after["restartCount"] == app_before["restartCount"], app_after
    assert app_after["state"]["running"]["startedAt"] == app_before["state"]["running"]["startedAt"]
    print(f"sidecar SIGKILL -> serving again after {back:.2f}s")
    assert back <= 12, back  # kubelet restart (no back-off on the first restart) + start-up


class Load:
    """Background requests across the pods while something is disrupted; each gets its own key,
    so only disruption (not a limit) can fail them."""

    def __init__(self, targets, path="/", headers=None):
        import threading
        self.targets, self.path, self.headers = targets, path, headers or {}
        self.results, self.stop = [], threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        i = 0
        while not self.stop.is_set():
            ip, port = self.targets[i % len(self.targets)]
            try:
                status = get(ip, port, self.path, headers={"x-api-key": f"load-{i}", **self.headers}, timeout=5)[0]
            except OSError as e:
                status = f"error: {e}"
            self.results.append((time.monotonic(), status))
            i += 1
            time.sleep(0.01)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(10)

    def counts(self, since=0.0):
        out = {}
        for t, s in self.results:
            if t >= since:
                out[s] = out.get(s, 0) + 1
        return out


def programmed_generation(name):
    rlp = kjson("get", "rlp", "-n", APP_NS, name)
    cond = next((c for c in rlp.get("status", {}).get("conditions", []) if c["type"] == "Programmed"), {})
    return cond.get("status") == "True" and cond.get("observedGeneration") == rlp["metadata"]["generation"]


def test_deleting_the_leader_keeps_sidecars_enforcing_and_status_written():
    leader = kjson("get", "lease", "-n", SYSTEM_NS, f"{RELEASE}-controller")["spec"]["holderIdentity"]
    with Load(app_targets()) as load:
        time.sleep(1)
        kubectl("delete", "pod", "-n", SYSTEM_NS, leader, "--wait=false")
        new = eventually("another replica leads", lambda: (lambda h: h if h and h != leader else None)(
            kjson("get", "lease", "-n", SYSTEM_NS, f"{RELEASE}-controller")["spec"].get("holderIdentity")), timeout=60)
        # The new leader writes status: a spec change is reported Programmed at its generation.
        kubectl("patch", "rlp", "-n", APP_NS, "shop-api-keys", "--type=merge", "-p",
                '{"metadata":{"labels":{"touched":"1"}},"spec":{"rules":[{"name":"per-api-key","key":[{"header":"x-api-key"}],'
                '"limit":{"requests":100,"period":"1m","burst":21,"algorithm":"TokenBucket"}}]}}')
        eventually("status written by the new leader", lambda: programmed_generation("shop-api-keys"), timeout=60)
        time.sleep(1)
    counts = load.counts()
    assert set(counts) == {200}, counts
    print(f"leader {leader} deleted -> {new} leads; {counts[200]} requests, all 200")
    kubectl("-n", SYSTEM_NS, "rollout", "status", f"deployment/{RELEASE}-controller", "--timeout=120s")


OUTAGE_POLICY = """
apiVersion: tollgate.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: shop-outage, namespace: shop}
spec:
  targetRef: {selector: {matchLabels: {app: shop-api}}}
  rules:
    - name: open-rule
      match: {headers: [{name: x-outage, value: open}]}
      limit: {requests: 100000, period: 1h}
      failureMode: Open
    - name: closed-rule
      match: {headers: [{name: x-outage, value: closed}]}
      limit: {requests: 100000, period: 1h}
      failureMode: Closed
"""


def test_a_redis_outage_follows_each_rules_failure_mode():
    apply(OUTAGE_POLICY)
    kubectl("wait", "-n", APP_NS, "rlp/shop-outage", "--for=condition=Programmed", "--timeout=60s")
    targets = app_targets()
    probe = lambda mode: [get(ip, port, "/", headers={"x-outage": mode, "x-api-key": f"o-{mode}-{ip}"})[0]
                          for ip, port in targets]
    eventually("both rules admit with Redis up", lambda: probe("open") == [200] * 3 and probe("closed") == [200] * 3)
    redis = pods(SYSTEM_NS, "app.kubernetes.io/component=redis")[0]["metadata"]["name"]
    # Stop Redis without a replacement: scale its Deployment to 0.
    kubectl("scale", "-n", SYSTEM_NS, f"deployment/{RELEASE}-redis", "--replicas=0")
    kubectl("wait", "-n", SYSTEM_NS, f"pod/{redis}", "--for=delete", "--timeout=60s")
    started = time.monotonic()
    eventually("closed rule answers 503", lambda: probe("closed") == [503] * 3, timeout=30)
    assert probe("open") == [200] * 3
    status, headers, body = get(targets[0][0], 8081, "/", headers={"x-outage": "closed", "x-api-key": "o-503"})
    assert status == 503 and int(headers["retry-after"]) >= 1, (status, headers)
    print(f"Redis down -> closed rule 503 after {time.monotonic() - started:.1f}s, open rule serving")
    # Recovery after the Redis pod is replaced is not asserted yet: on this node the sidecars
    # kept answering 503 for the closed rule 90 s after the new Redis pod was Ready (an open
    # defect, see the closing note of issue 14). Redis comes back for the tests after this one.
    kubectl("scale", "-n", SYSTEM_NS, f"deployment/{RELEASE}-redis", "--replicas=1")


def test_helm_upgrade_of_a_sidecar_setting_reaches_new_pods():
    helm("upgrade", RELEASE, os.path.join(ROOT, "charts/tollgate"), "-n", SYSTEM_NS, "--reuse-values",
         "--set", "sidecar.resources.limits.memory=96Mi", "--wait")
    old = pods(APP_NS, f"app={APP}")[0]["metadata"]["name"]
    kubectl("delete", "pod", "-n", APP_NS, old)
    fresh = [p for p in app_pods_ready(3) if p["metadata"]["name"] != old]
    newest = max(fresh, key=lambda p: p["metadata"]["creationTimestamp"])
    side = next(c for c in newest["spec"]["initContainers"] if c["name"] == "tollgate-sidecar")
    assert side["resources"]["limits"]["memory"] == "96Mi", side["resources"]


def test_uninstall_leaves_only_what_the_docs_say():
    helm("uninstall", RELEASE, "-n", SYSTEM_NS, "--wait", "--timeout", "120s")
    eventually("controller pods gone", lambda: not pods(SYSTEM_NS, CONTROLLER), timeout=120)
    eventually("membership Leases garbage-collected", lambda: not kjson(
        "get", "lease", "-n", SYSTEM_NS, "-l", "tollgate.dev/membership-of")["items"], timeout=60)
    remaining = kubectl("get", "all,lease,secret,configmap,serviceaccount,role,rolebinding", "-n", SYSTEM_NS,
                        "-o", "name").stdout.split()
    kept = {"secret/tollgate-webhook-tls", "configmap/kube-root-ca.crt", "serviceaccount/default"}
    assert set(remaining) <= kept, remaining
    assert kubectl("get", "crd", "ratelimitpolicies.tollgate.dev", check=False).returncode == 0
    for kind in ["clusterrole", "clusterrolebinding", "mutatingwebhookconfiguration", "validatingwebhookconfiguration"]:
        out = kubectl("get", kind, "-l", f"app.kubernetes.io/instance={RELEASE}", "-o", "name").stdout.strip()
        assert not out, out


def sidecar_restarts():
    return {p["metadata"]["name"]: sidecar_status(p)["restartCount"] for p in pods(APP_NS, f"app={APP}")}


def current_rules_reach_every_pod(marker):
    """A new policy made after the (re)install is enforced by every running pod: proof that each
    sidecar is on the new controller's stream, with current rules. The apply is retried: right
    after a rollout, kube-proxy may not yet route the webhook Service to the new endpoints."""
    eventually("the policy is accepted by the new controller's webhook", lambda: kubectl("apply", "-f", "-", check=False, input=f"""
apiVersion: tollgate.dev/v1alpha1
kind: RateLimitPolicy
metadata: {{name: {marker}, namespace: shop}}
spec:
  targetRef: {{selector: {{matchLabels: {{app: shop-api}}}}}}
  rules:
    - name: once
      match: {{path: {{prefix: /{marker}}}}}
      scope: Local
      limit: {{requests: 1, period: 1h}}
""").returncode == 0, timeout=60, every=1)
    started = time.monotonic()
    for ip, port in app_targets():
        # The first request is admitted (404: no such file), the second rejected once the rule is there.
        eventually(f"{ip} enforces {marker}", lambda: get(ip, port, f"/{marker}")[0] == 429, timeout=30)
    return time.monotonic() - started


def test_reinstall_reconnects_running_sidecars_without_restarts():
    before = sidecar_restarts()
    started = time.monotonic()
    helm("install", RELEASE, os.path.join(ROOT, "charts/tollgate"), "-n", SYSTEM_NS, *REDIS_DEV, "--wait")
    took = current_rules_reach_every_pod("after-helm-reinstall")
    print(f"helm reinstall -> current rules in every pod after {time.monotonic() - started:.1f}s ({took:.1f}s after apply)")
    assert sidecar_restarts() == before


def test_switching_from_helm_to_install_yaml_keeps_running_sidecars():
    before = sidecar_restarts()
    helm("uninstall", RELEASE, "-n", SYSTEM_NS, "--wait", "--timeout", "120s")
    started = time.monotonic()
    kubectl("apply", "-f", os.path.join(ROOT, "manifests/install.yaml"))
    kubectl("-n", SYSTEM_NS, "rollout", "status", f"deployment/{RELEASE}-controller", "--timeout=180s")
    current_rules_reach_every_pod("after-install-yaml")
    print(f"helm -> install.yaml: current rules in every pod after {time.monotonic() - started:.1f}s")
    assert sidecar_restarts() == before
