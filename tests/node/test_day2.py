"""Day 2 on a real node: tollgate installed as a new user would (the README's commands), then run
the way a cluster runs, not within seconds of a fresh start:

1. the cluster keeps running past every idle timeout between sidecars and controller replicas
   (at least 3 minutes after the install, 95 s after the sidecars connected) before a policy is
   applied and edited; `kubectl wait --for=condition=Programmed --timeout=30s` must succeed after
   each (what a CD gate runs), and `status.propagation` must be plausible;
2. a sidecar whose stream token the controller refuses (wrong audience) must not end in
   pass-through: it stays unready and says why (docs/rule-stream.md, operations.md);
3. the controller is scaled to 0 during an app scale-up: in a namespace labelled
   `tollgate.dev/inject: enabled` the new pods run without the sidecar and the returning
   controller reports them (Event `SidecarMissing`, `status.podsWithoutSidecar`, condition
   `SidecarsInjected`); in one labelled `required` no pod is created without it
   (docs/install.md, "When something fails" and "Pods without the sidecar");
4. `helm uninstall`: the injected pods stop enforcing the policies of the removed installation;
5. `helm install` again: policies are Programmed and enforced on the running pods.

Everything it creates is removed at the end, so tests/node/test_user_path.py starts from an
empty cluster. The phases record every failed expectation and the test fails at the end with
all of them, so one run shows each broken promise (not only the first)."""
import json
import os
import re
import subprocess
import time
from datetime import datetime, timezone

from conftest import RELEASE, ROOT, SYSTEM_NS, apply, eventually, get, helm, kjson, kubectl, pods, ready

NS, REQUIRED_NS, STRAY_NS = "day2", "day2-required", "day2-stray"
APP = "day2-app"
CHART = os.path.join(ROOT, "charts/tollgate")
CONTROLLER = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=controller"
REDIS_DEV = ["--set", "redis.dev.enabled=true", "--set", "redis.dev.image.repository=tollgate.test/redis",
             "--set-string", "redis.dev.image.tag=7"]
# An HTTP client's idle connection timeout is 90 s; the test waits past it, and at least 3
# minutes of cluster uptime, before it touches a policy.
IDLE_AFTER_CONNECT_S, MIN_UPTIME_S = 95, 180
# docs/install.md: the leader looks for pods without the sidecar every --coverage-interval (15 s).
COVERAGE_INTERVAL_S = 15
# docs/rule-stream.md: with several replicas, propagation includes up to one --heartbeat-interval.
HEARTBEAT_S = 5


class Expectations:
    """Failed expectations, in order; the test fails at the end listing all of them."""

    def __init__(self):
        self.failed = []

    def check(self, ok, what):
        if not ok:
            self.failed.append(what)
            print(f"FAILED EXPECTATION: {what}")
        return ok

    def eventually(self, what, fn, timeout, every=0.5):
        try:
            return eventually(what, fn, timeout=timeout, every=every)
        except AssertionError as e:
            self.check(False, str(e))
            return None


def readme_install_commands():
    """The README's "On a cluster" commands that install and opt a namespace in."""
    with open(os.path.join(ROOT, "README.md")) as f:
        block = re.search(r"## On a cluster.*?```sh\n(.*?)```", f.read(), re.S)
    assert block, "README.md has no 'On a cluster' sh block"
    lines = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines() if line.strip()]
    install = next(line for line in lines if line.startswith("helm install"))
    label = next(line for line in lines if line.startswith("kubectl label namespace"))
    return install, label


def sh(cmd, timeout=240):
    env = dict(os.environ, PATH=os.environ["K8SBIN_DIR"] + ":" + os.environ["PATH"])
    p = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{cmd}\n{p.stdout}\n{p.stderr}"
    return p.stdout


def install(readme_install):
    sh(readme_install + " " + " ".join(REDIS_DEV))
    eventually("controller pods Ready", lambda: (lambda ps: len(ps) == 2 and all(map(ready, ps)))(
        [p for p in pods(SYSTEM_NS, CONTROLLER) if not p["metadata"].get("deletionTimestamp")]), timeout=120)


def deployment(ns, replicas):
    return json.dumps({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": APP, "namespace": ns},
        "spec": {
            "replicas": replicas, "selector": {"matchLabels": {"app": APP}},
            "template": {"metadata": {"labels": {"app": APP}}, "spec": {
                "terminationGracePeriodSeconds": 2,
                "containers": [{
                    "name": "app", "image": "tollgate.test/app:1", "imagePullPolicy": "Never",
                    "args": ["-p", "127.0.0.1:8080"], "ports": [{"name": "http", "containerPort": 8080}],
                }]}}}})


def has_sidecar(pod):
    return any(c["name"] == "tollgate-sidecar" for c in pod["spec"].get("initContainers", []))


def live_pods(ns):
    return [p for p in pods(ns, f"app={APP}") if not p["metadata"].get("deletionTimestamp")]


def injection_serves(ns):
    pod = json.loads(kubectl("run", "probe", "-n", ns, "--image=tollgate.test/app:1", "--port=8080",
                             "--dry-run=server", "-o", "json").stdout)
    return has_sidecar(pod)


def metric(ip, name):
    for line in get(ip, 9091, "/metrics")[2].decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def policy(name, marker, extra=""):
    """A policy with one rule admitting 1 request per hour on /<marker>, per sidecar."""
    return f"""
apiVersion: tollgate.dev/v1alpha1
kind: RateLimitPolicy
metadata: {{name: {name}, namespace: {NS}}}
spec:
  targetRef: {{selector: {{matchLabels: {{app: {APP}}}}}}}
  rules:
  - name: {marker}
    match: {{path: {{prefix: /{marker}}}}}
    scope: Local
    limit: {{requests: 1, period: 1h}}
{extra}"""


def enforces(ip, marker):
    """The first request to /<marker> is admitted (404 from the app), the next rejected."""
    return get(ip, 8081, f"/{marker}")[0] == 429


def every_pod_enforces(x, marker, timeout):
    """Every injected app pod enforces the rule on /<marker>, polled together (a pod counts once
    it answered 429)."""
    pending = set(sidecar_ips())

    def check():
        pending.difference_update({ip for ip in list(pending) if enforces(ip, marker)})
        return not pending
    try:
        eventually(f"every injected pod enforces /{marker}", check, timeout=timeout, every=0.05)
    except AssertionError:
        x.check(False, f"not every injected pod enforces /{marker} after {timeout}s: {sorted(pending)} do not")


def sidecar_ips():
    return [p["status"]["podIP"] for p in live_pods(NS) if has_sidecar(p) and p["status"].get("podIP")]


def wait_programmed(name, timeout="30s"):
    p = kubectl("wait", "-n", NS, f"rlp/{name}", "--for=condition=Programmed", f"--timeout={timeout}", check=False)
    return p.returncode == 0, (p.stdout + p.stderr).strip()


def condition(obj, kind):
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == kind), {})


def wrong_audience_sidecar(template):
    """A bare pod running the injected sidecar's container, exactly as injected, but with a
    ServiceAccount token for another audience: the controller refuses it (401)."""
    side = json.loads(json.dumps(next(c for c in template["spec"]["initContainers"] if c["name"] == "tollgate-sidecar")))
    side.pop("restartPolicy", None)
    side["args"] = [a for a in side["args"] if not a.startswith("--rules-wait")] + ["--rules-wait=3s"]
    names = {m["name"] for m in side.get("volumeMounts", [])}
    volumes = json.loads(json.dumps([v for v in template["spec"]["volumes"] if v["name"] in names]))
    for v in volumes:
        for src in v.get("projected", {}).get("sources", []):
            if "serviceAccountToken" in src:
                src["serviceAccountToken"]["audience"] = "not-tollgate"
    return json.dumps({"apiVersion": "v1", "kind": "Pod",
                       "metadata": {"name": "wrong-audience", "namespace": STRAY_NS},
                       "spec": {"containers": [side], "volumes": volumes, "terminationGracePeriodSeconds": 1}})


def test_day_two_on_a_running_cluster():
    started = time.monotonic()
    readme_install, readme_label = readme_install_commands()
    x = Expectations()
    try:
        day_two(x, readme_install, readme_label, started)
    finally:
        clean_up()
        print(f"MEASURE day-2 test took {time.monotonic() - started:.0f}s")
    assert not x.failed, "day-2 expectations failed:\n- " + "\n- ".join(x.failed)


def day_two(x, readme_install, readme_label, started):
    # --- Install as the README says, with the dev Redis it names for global limits.
    for ns in (NS, REQUIRED_NS, STRAY_NS):
        kubectl("create", "namespace", ns)
    install(readme_install)
    sh(readme_label.replace(" shop ", f" {NS} "))
    kubectl("label", "namespace", REQUIRED_NS, "tollgate.dev/inject=required")
    eventually("the injection webhook answers through its Service", lambda: injection_serves(NS), timeout=60, every=1)
    apply(deployment(NS, 3))
    apply(deployment(REQUIRED_NS, 1))
    app = eventually("3 app pods Ready with the sidecar", lambda: (lambda ps: ps if len(ps) == 3 and all(
        ready(p) and has_sidecar(p) for p in ps) else None)(live_pods(NS)), timeout=120)
    eventually("the required namespace's pod Ready", lambda: (lambda ps: len(ps) == 1 and ready(ps[0]))(
        live_pods(REQUIRED_NS)), timeout=120)
    for p in app:
        ip = p["status"]["podIP"]
        eventually(f"{p['metadata']['name']} stream connected",
                   lambda: metric(ip, "tollgate_controller_connected") == 1, timeout=30)
    connected = time.monotonic()

    # --- A sidecar the controller refuses (token for another audience), started now so its
    # --rules-wait (3 s) passes many times over during the idle wait.
    apply(wrong_audience_sidecar(app[0]))

    # --- Idle, as a cluster is between deploys.
    idle = max(connected + IDLE_AFTER_CONNECT_S, started + MIN_UPTIME_S) - time.monotonic()
    print(f"MEASURE idle {idle:.0f}s before touching a policy ({time.monotonic() - connected:.0f}s after connect)")
    time.sleep(max(0.0, idle))

    refused_sidecar(x)
    apply_and_edit(x)
    controller_outage(x)
    uninstall_and_reinstall(x, readme_install)


def refused_sidecar(x):
    pod = kjson("get", "pod", "-n", STRAY_NS, "wrong-audience")
    ip = pod["status"].get("podIP")
    if not x.check(ip, f"the wrong-audience sidecar pod has no IP: {pod['status']}"):
        return
    x.check(not ready(pod), "a sidecar whose token the controller refuses turned Ready")
    x.check(metric(ip, "tollgate_rules_passthrough") == 0,
            f"a refused sidecar serves without limits: tollgate_rules_passthrough={metric(ip, 'tollgate_rules_passthrough')}")
    x.check(metric(ip, "tollgate_controller_stream_refused") == 1,
            f"tollgate_controller_stream_refused={metric(ip, 'tollgate_controller_stream_refused')} (want 1)")
    body = get(ip, 9091, "/readyz")[2].decode(errors="replace")
    x.check("refused" in body and "token" in body, f"/readyz does not say the token was refused: {body!r}")
    kubectl("delete", "pod", "-n", STRAY_NS, "wrong-audience", "--wait=false")


def apply_and_edit(x):
    before = datetime.now(timezone.utc)
    applied = time.monotonic()
    apply(policy("day2-limits", "applied"))
    ok, out = wait_programmed("day2-limits")
    x.check(ok, f"kubectl wait --for=condition=Programmed --timeout=30s after an apply, "
                f"{IDLE_AFTER_CONNECT_S}+ s after the sidecars connected: {out}")
    # Every pod enforces the rule (what Programmed promises).
    every_pod_enforces(x, "applied", timeout=10)
    enforced_ms = (time.monotonic() - applied) * 1000
    rlp = kjson("get", "rlp", "-n", NS, "day2-limits")
    prop = rlp.get("status", {}).get("propagation") or {}
    print(f"MEASURE after idle: apply -> every pod enforces {enforced_ms:.0f} ms; status.propagation {prop}; "
          f"Programmed: {condition(rlp, 'Programmed').get('message')}")
    x.check(prop.get("generation") == rlp["metadata"]["generation"], f"status.propagation is not for this generation: {prop}")
    ms = prop.get("durationMillis")
    x.check(ms is not None and 0 < ms <= enforced_ms + HEARTBEAT_S * 1000,
            f"status.propagation.durationMillis {ms} is not within the apply->enforced {enforced_ms:.0f} ms "
            f"plus one heartbeat ({HEARTBEAT_S} s)")
    completed = prop.get("completed")
    if x.check(completed, f"status.propagation has no completed time: {prop}"):
        at = datetime.fromisoformat(completed.replace("Z", "+00:00"))
        x.check((at - before).total_seconds() > -2, f"status.propagation.completed {completed} is before the apply ({before})")

    # An edit, the same way.
    edited = time.monotonic()
    apply(policy("day2-limits", "applied", extra="""  - name: edited
    match: {path: {prefix: /edited}}
    scope: Local
    limit: {requests: 1, period: 1h}
"""))
    ok, out = wait_programmed("day2-limits")
    x.check(ok, f"kubectl wait --for=condition=Programmed --timeout=30s after an edit: {out}")
    rlp = kjson("get", "rlp", "-n", NS, "day2-limits")
    programmed = condition(rlp, "Programmed")
    x.check(programmed.get("status") == "True" and programmed.get("observedGeneration") == rlp["metadata"]["generation"],
            f"Programmed after the edit is not about the edited generation: {programmed}")
    every_pod_enforces(x, "edited", timeout=10)
    print(f"MEASURE after idle: edit -> every pod enforces {(time.monotonic() - edited) * 1000:.0f} ms; "
          f"status.propagation {rlp.get('status', {}).get('propagation')}")


def controller_outage(x):
    kubectl("scale", "-n", SYSTEM_NS, f"deployment/{RELEASE}-controller", "--replicas=0")
    eventually("no controller pod left", lambda: not pods(SYSTEM_NS, CONTROLLER), timeout=90)
    kubectl("scale", "-n", NS, f"deployment/{APP}", "--replicas=5")
    kubectl("scale", "-n", REQUIRED_NS, f"deployment/{APP}", "--replicas=2")
    bare = eventually("2 new pods Running in the enabled namespace", lambda: (lambda ps: ps if len(ps) == 2 and all(
        ready(p) for p in ps) else None)([p for p in live_pods(NS) if not has_sidecar(p)]), timeout=60)
    bare_names = sorted(p["metadata"]["name"] for p in bare)
    # The required namespace creates no pod while no controller answers: the ReplicaSet says why.
    refusal = x.eventually("the required namespace's ReplicaSet reports the refused pod", lambda: [
        e for e in kjson("get", "events", "-n", REQUIRED_NS)["items"]
        if e.get("reason") == "FailedCreate" and "required.inject.tollgate.dev" in e.get("message", "")], timeout=30)
    x.check(len(live_pods(REQUIRED_NS)) == 1 and all(has_sidecar(p) for p in live_pods(REQUIRED_NS)),
            f"a pod was created in the required namespace without a controller: "
            f"{[(p['metadata']['name'], has_sidecar(p)) for p in live_pods(REQUIRED_NS)]} (events: {bool(refusal)})")

    kubectl("scale", "-n", SYSTEM_NS, f"deployment/{RELEASE}-controller", "--replicas=2")
    back = time.monotonic()
    eventually("controller pods Ready again", lambda: (lambda ps: len(ps) == 2 and all(map(ready, ps)))(
        pods(SYSTEM_NS, CONTROLLER)), timeout=120)
    x.eventually("the required namespace's second pod is created with the sidecar once a controller answers",
                 lambda: (lambda ps: len(ps) == 2 and all(ready(p) and has_sidecar(p) for p in ps))(live_pods(REQUIRED_NS)),
                 timeout=90, every=1)

    # The pods created meanwhile are reported (docs/install.md, "Pods without the sidecar").
    def reported():
        rlp = kjson("get", "rlp", "-n", NS, "day2-limits")
        return rlp if rlp.get("status", {}).get("podsWithoutSidecar") == 2 else None
    rlp = x.eventually("status.podsWithoutSidecar counts the 2 pods created without the sidecar", reported,
                       timeout=COVERAGE_INTERVAL_S * 2 + 30, every=1)
    if rlp:
        injected = condition(rlp, "SidecarsInjected")
        x.check(injected.get("status") == "False" and injected.get("reason") == "PodsWithoutSidecar"
                and all(n in injected.get("message", "") for n in bare_names),
                f"condition SidecarsInjected does not name the pods without the sidecar {bare_names}: {injected}")
    events = kjson("get", "events", "-n", NS)["items"]
    for name in bare_names:
        x.check(any(e.get("reason") == "SidecarMissing" and e.get("type") == "Warning"
                    and e.get("involvedObject", {}).get("name") == name and "day2-limits" in e.get("message", "")
                    for e in events),
                f"no Warning Event SidecarMissing on {name} naming the policy")
    x.check(any(e.get("reason") == "PodsWithoutSidecar" and e.get("involvedObject", {}).get("name") == "day2-limits"
                for e in events), "no Warning Event PodsWithoutSidecar on the policy")
    print(f"MEASURE controller back -> pods without sidecar reported after {time.monotonic() - back:.0f}s")


def uninstall_and_reinstall(x, readme_install):
    ips = sidecar_ips()
    for ip in ips:
        x.check(enforces(ip, "applied"), f"{ip} did not enforce the policy before the uninstall")
    sh(f"helm uninstall {RELEASE} -n {SYSTEM_NS} --wait --timeout 120s")
    gone = time.monotonic()
    # The installation is gone: its pods stop enforcing its policies (docs/install.md, uninstall).
    x.eventually("every injected pod stops enforcing after helm uninstall", lambda: all(
        get(ip, 8081, "/applied")[0] != 429 for ip in ips for _ in range(2)), timeout=45, every=1)
    print(f"MEASURE helm uninstall -> pods stopped enforcing after {time.monotonic() - gone:.0f}s")
    x.check(all(ready(p) for p in live_pods(NS) if has_sidecar(p)), "injected pods turned unready after the uninstall")

    install(readme_install)
    eventually("the reinstalled webhook answers", lambda: kubectl(
        "apply", "-f", "-", check=False, input=policy("day2-after", "reinstalled")).returncode == 0, timeout=60, every=1)
    ok, out = wait_programmed("day2-after")
    x.check(ok, f"kubectl wait --for=condition=Programmed --timeout=30s after the reinstall: {out}")
    every_pod_enforces(x, "reinstalled", timeout=30)


def clean_up():
    """Leave the cluster as test_user_path.py expects a new user's to be: nothing of tollgate."""
    helm("uninstall", RELEASE, "-n", SYSTEM_NS, "--wait", "--timeout", "120s", check=False)
    for ns in (NS, REQUIRED_NS, STRAY_NS):
        kubectl("delete", "namespace", ns, "--wait=false", check=False)
    # Waited for: a CRD still being deleted when the next test installs the chart (which skips an
    # existing CRD) would vanish under it.
    kubectl("delete", "crd", "ratelimitpolicies.tollgate.dev", "--timeout=60s", check=False)
    kubectl("delete", "secret", "-n", SYSTEM_NS, f"{RELEASE}-webhook-tls", f"{RELEASE}-key-hash", check=False)
