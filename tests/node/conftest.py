"""Helpers for the real-node tests: they run inside the node's namespaces (tools/node/exec.sh),
where KUBECONFIG, K8SBIN_DIR and NODE_RUN are set by tools/node/up.sh."""
import http.client
import json
import os
import subprocess
import time

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
RELEASE, SYSTEM_NS, APP_NS = "tollgate", "tollgate-system", "shop"


def need_env(name):
    value = os.environ.get(name)
    if not value:
        pytest.fail(f"{name} is not set: run these tests through tools/node/run-tests.sh "
                    "(./tools/test-all.sh does), which starts the node and enters its namespaces")
    return value


def run(*args, check=True, input=None, timeout=120):
    p = subprocess.run(list(args), capture_output=True, text=True, input=input, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def kubectl(*args, **kw):
    return run("kubectl", *args, **kw)


def kjson(*args):
    return json.loads(kubectl(*args, "-o", "json").stdout)


def helm(*args, **kw):
    return run(os.path.join(need_env("K8SBIN_DIR"), "helm"), *args, **kw)


def apply(manifest):
    return kubectl("apply", "-f", "-", input=manifest)


def eventually(what, fn, timeout=60.0, every=0.25):
    """Polls fn until it returns a truthy value; fails naming `what` and the last value."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            last = fn()
            if last:
                return last
        except Exception as e:  # a transient API or connection error: keep polling
            last = e
        time.sleep(every)
    raise AssertionError(f"{what}: not true after {timeout}s (last: {last!r})")


def get(host, port, path="/", headers=None, source=None, timeout=5):
    """One HTTP/1.1 request; returns (status, headers dict lower-cased, body)."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout,
                                      source_address=(source, 0) if source else None)
    try:
        conn.request("GET", path, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def pods(ns, selector):
    return kjson("get", "pods", "-n", ns, "-l", selector)["items"]


def ready(pod):
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def memory_charged(proc_cgroup, root="/sys/fs/cgroup"):
    """Bytes charged to the memory cgroup of a process whose /proc/PID/cgroup reads
    `proc_cgroup` (what its memory limit is enforced against). cgroup v1 (a `memory` controller
    line, as on this test node): memory.usage_in_bytes in the memory hierarchy. cgroup v2 (only
    the unified `0::` line, as on most current nodes): memory.current. tests/node/test_cgroup.py
    covers both with fake trees."""
    groups = dict((parts[1], parts[2].strip()) for parts in
                  (line.split(":", 2) for line in proc_cgroup.splitlines() if line.strip()))
    v1 = next((path for controllers, path in groups.items() if "memory" in controllers.split(",")), None)
    if v1 is not None:
        path = os.path.join(root, "memory", v1.lstrip("/"), "memory.usage_in_bytes")
    else:
        path = os.path.join(root, groups[""].lstrip("/"), "memory.current")
    with open(path) as f:
        return int(f.read())
