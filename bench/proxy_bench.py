#!/usr/bin/env python3
"""Side-by-side localhost proxy benchmark for tollgate-sidecar (see bench/README.md).

Normally started by bench/proxy.sh, which installs the tools and builds the sidecar first and
passes their paths in the environment (SIDECAR_BIN, OHA, WRK, NGINX, ENVOY).

Paths, run interleaved (A B C D A B C D ...) for REPS repetitions:
  direct   load generator -> nginx `return 200` (1 worker)                 the baseline
  tollgate load generator -> tollgate-sidecar -> app   (per-IP Local token bucket, 1e9/s)
  nginx    load generator -> nginx proxy_pass + limit_req (per IP, nodelay) -> app
  envoy    load generator -> Envoy --concurrency 1 + local_ratelimit -> app

Proxies run on CPU 1, the load generator and the app on CPU 0. Only the Python standard
library is used; the SVG plot is written by hand.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")

QUICK = os.environ.get("QUICK", "0") not in ("", "0", "false", "no")


def env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    return int(v) if v else default


REPS = env_int("REPS", 3 if QUICK else 5)
LOAD_SECS = env_int("LOAD_SECS", 3 if QUICK else 8)
SAT_SECS = env_int("SAT_SECS", 3 if QUICK else 5)
RATES = [int(r) for r in os.environ.get("RATES", "1000,5000").split(",") if r]
CONNS = env_int("CONNS", 16)
SAT_CONNS = env_int("SAT_CONNS", 32)
KEYS = env_int("KEYS", 100_000)
NICE = env_int("NICE", -10)
# SCHED=fifo (default) runs every benchmark process as SCHED_FIFO priority 1 (chrt): their
# wakeups preempt background compiles at once, and the kernel still keeps ~5% of each CPU for
# normal tasks. SCHED=nice uses `nice -n NICE` instead (gentler on others, much noisier).
SCHED = os.environ.get("SCHED", "fifo")
SUT_CPU = os.environ.get("SUT_CPU", "1")
GEN_CPU = os.environ.get("GEN_CPU", "0")
PATHS = [p for p in os.environ.get("PATHS", "direct,tollgate,nginx,envoy").split(",") if p]
OUT_DIR = Path(os.environ.get("OUT_DIR", str(BENCH / "results")))
PIDFILE = os.environ.get("BENCH_PIDFILE")

SIDECAR_BIN = os.environ.get("SIDECAR_BIN", str(ROOT / "target/release/tollgate-sidecar"))
_OHA_CACHED = ROOT / ".cache/tools/bin/oha"
OHA = os.environ.get("OHA", str(_OHA_CACHED) if _OHA_CACHED.exists() else "oha")
WRK = os.environ.get("WRK", "wrk")
NGINX = os.environ.get("NGINX", "nginx")
_ENVOY_CACHED = next((ROOT / ".cache/bench-venv/lib").glob("python3*/site-packages/envoy/_bin/envoy"),
                     None) if (ROOT / ".cache/bench-venv/lib").exists() else None
ENVOY = os.environ.get("ENVOY", str(_ENVOY_CACHED) if _ENVOY_CACHED else "envoy")

LABELS = {
    "direct": "direct (nginx return 200)",
    "tollgate": "tollgate-sidecar",
    "nginx": "nginx proxy_pass + limit_req",
    "envoy": "Envoy + local_ratelimit",
}
COLORS = {"direct": "#888888", "tollgate": "#1f77b4", "nginx": "#2ca02c", "envoy": "#d62728"}

# ---------------------------------------------------------------------------------------------
# Process bookkeeping: every process this script starts is recorded and killed by its PID.

STARTED: list[tuple[str, subprocess.Popen]] = []
EXTRA_PIDS: list[tuple[str, int]] = []  # e.g. nginx workers (children of a recorded master)


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def record_pid(name: str, pid: int) -> None:
    """Appends `PID COMM` to BENCH_PIDFILE, so proxy.sh's EXIT trap can kill exactly these."""
    if PIDFILE:
        with open(PIDFILE, "a") as f:
            f.write(f"{pid} {name[:15]}\n")


def comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def prefix(cpu: str) -> list[str]:
    p = ["taskset", "-c", cpu]
    if SCHED == "fifo":
        p = ["chrt", "-f", "1"] + p
    elif NICE:
        p = ["nice", "-n", str(NICE)] + p
    return p


def sched_text() -> str:
    if SCHED == "fifo":
        return ", all SCHED_FIFO priority 1"
    return f", all at nice {NICE}" if NICE else ""


def spawn(name: str, argv: list[str], cpu: str, logfile: Path) -> subprocess.Popen:
    out = open(logfile, "ab")
    # nice and taskset exec the command, so the PID is the command's own.
    p = subprocess.Popen(prefix(cpu) + argv, stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                         start_new_session=True)
    STARTED.append((name, p))
    record_pid(Path(argv[0]).name, p.pid)
    return p


def children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            txt = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
            out += [int(x) for x in txt]
    except OSError:
        pass
    return out


def stop(name: str, p: subprocess.Popen) -> None:
    if p.poll() is not None:
        return
    try:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(timeout=5)
    except ProcessLookupError:
        pass


def cleanup() -> None:
    for name, p in reversed(STARTED):
        stop(name, p)
    for name, pid in EXTRA_PIDS:
        if comm(pid) == name:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    STARTED.clear()
    EXTRA_PIDS.clear()


def on_signal(signum, _frame):
    raise SystemExit(128 + signum)


# ---------------------------------------------------------------------------------------------
# Small helpers


def free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def http_get(url: str, headers: dict | None = None, timeout: float = 2.0) -> tuple[int, str]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def wait_http(url: str, proc: subprocess.Popen, what: str, secs: float = 20.0) -> None:
    deadline = time.time() + secs
    last = None
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} during startup")
        try:
            code, _ = http_get(url, timeout=1.0)
            if code == 200:
                return
            last = f"HTTP {code}"
        except Exception as e:  # noqa: BLE001 - startup polling
            last = str(e)
        time.sleep(0.1)
    raise RuntimeError(f"{what} not ready at {url}: {last}")


def proc_cpu_ticks(pids: list[int]) -> int:
    """utime+stime (clock ticks) of the processes, all threads included."""
    total = 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        total += int(fields[11]) + int(fields[12])  # fields 14 and 15 of stat(5)
    return total


def rss_kib(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def threads(pids: list[int]) -> int:
    n = 0
    for pid in pids:
        try:
            n += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            pass
    return n


def core_busy_ticks(cpu: str) -> int:
    """Busy ticks of one CPU from /proc/stat (everything but idle and iowait)."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith(f"cpu{cpu} "):
            v = [int(x) for x in line.split()[1:]]
            return v[0] + v[1] + v[2] + v[5] + v[6] + v[7]  # user nice system irq softirq steal
    return 0


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def busiest_foreign(limit: int = 5) -> list[str]:
    mine = {p.pid for _, p in STARTED} | {pid for _, pid in EXTRA_PIDS} | {os.getpid()}
    for _, p in STARTED:
        mine |= set(children(p.pid))
    out = subprocess.run(["ps", "-eo", "pid,ni,pcpu,comm", "--sort=-pcpu", "--no-headers"],
                         capture_output=True, text=True).stdout.splitlines()
    rows = []
    for line in out:
        parts = line.split(None, 3)
        if len(parts) == 4 and int(parts[0]) not in mine and parts[3] not in ("ps",):
            rows.append(f"{parts[3]} (nice {parts[1]}, {parts[2]}% avg)")
        if len(rows) >= limit:
            break
    return rows


def tool_version(argv: list[str]) -> str:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=20)
        txt = (r.stdout + r.stderr).strip().splitlines()
        return txt[0].strip() if txt else "?"
    except Exception as e:  # noqa: BLE001
        return f"? ({e})"


# ---------------------------------------------------------------------------------------------
# Configurations


def nginx_common(work: Path, name: str) -> str:
    t = work / f"{name}-tmp"
    t.mkdir(exist_ok=True)
    return f"""
worker_processes 1;
pid {work}/{name}.pid;
error_log {work}/{name}-error.log warn;
events {{ worker_connections 4096; multi_accept on; }}
http {{
  access_log off;
  client_body_temp_path {t}/body;
  proxy_temp_path {t}/proxy;
  fastcgi_temp_path {t}/fastcgi;
  uwsgi_temp_path {t}/uwsgi;
  scgi_temp_path {t}/scgi;
  keepalive_requests 100000000;
  keepalive_timeout 75s;
  default_type text/plain;
"""


def write_app_conf(work: Path, port: int) -> Path:
    conf = work / "app.conf"
    conf.write_text(nginx_common(work, "app") + f"""
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    location / {{ return 200 "ok\\n"; }}
  }}
}}
""")
    return conf


def write_nginx_proxy_conf(work: Path, port: int, app_port: int) -> Path:
    conf = work / "nginx-proxy.conf"
    conf.write_text(nginx_common(work, "nginx-proxy") + f"""
  limit_req_zone $binary_remote_addr zone=perip:10m rate=10000000r/s;
  upstream app {{
    server 127.0.0.1:{app_port};
    keepalive 64;
    keepalive_requests 100000000;
  }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    location / {{
      limit_req zone=perip burst=1000000 nodelay;
      proxy_pass http://app;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }}
  }}
}}
""")
    return conf


def write_envoy_conf(work: Path, port: int, admin_port: int, app_port: int) -> Path:
    conf = work / "envoy.yaml"
    conf.write_text(f"""
admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin_port}}}}}
static_resources:
  listeners:
  - name: ingress
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ingress
          codec_type: AUTO
          route_config:
            virtual_hosts:
            - name: app
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: app}}
          http_filters:
          - name: envoy.filters.http.local_ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit
              stat_prefix: http_local_rate_limiter
              token_bucket: {{max_tokens: 1000000000, tokens_per_fill: 1000000000, fill_interval: 1s}}
              filter_enabled:
                runtime_key: local_rate_limit_enabled
                default_value: {{numerator: 100, denominator: HUNDRED}}
              filter_enforced:
                runtime_key: local_rate_limit_enforced
                default_value: {{numerator: 100, denominator: HUNDRED}}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: app
    connect_timeout: 1s
    type: STATIC
    load_assignment:
      cluster_name: app
      endpoints:
      - lb_endpoints:
        - endpoint:
            address: {{socket_address: {{address: 127.0.0.1, port_value: {app_port}}}}}
""")
    return conf


POLICY_PER_IP = """# Exercised on every request, never rejects: per-client-IP token bucket, 1e9 per second.
apiVersion: tollgate.dev/v1alpha1
kind: RateLimitPolicy
metadata:
  name: bench
  namespace: default
spec:
  targetRef:
    selector: {}
  rules:
    - name: per-ip
      key:
        - clientIP: {}
      limit:
        requests: 1000000000
        period: 1s
        algorithm: TokenBucket
      scope: Local
"""

POLICY_KEYS = """# One bucket per x-bench-key value. 1000 per 24h: one request leaves a bucket non-full (so
# not evictable) for ~86 s, long enough to read the RSS with every key live.
apiVersion: tollgate.dev/v1alpha1
kind: RateLimitPolicy
metadata:
  name: bench-keys
  namespace: default
spec:
  targetRef:
    selector: {}
  rules:
    - name: per-key
      key:
        - header: x-bench-key
      limit:
        requests: 1000
        period: 24h
        algorithm: TokenBucket
      scope: Local
"""

WRK_KEYS_LUA = """-- Sends x-bench-key: <n> with n counting up from the first script argument.
local n = 0
local modulo = 0
function init(args)
  n = tonumber(args[1]) or 0
  modulo = tonumber(args[2]) or 100000
end
function request()
  n = n + 1
  return wrk.format(nil, nil, {["x-bench-key"] = tostring(n % modulo)})
end
"""

# ---------------------------------------------------------------------------------------------
# Systems under test


class Path_:
    def __init__(self, name: str, url: str, procs: list[subprocess.Popen]):
        self.name = name
        self.url = url
        self.procs = procs
        self.rss_idle_kib = 0
        self.rss_after_kib = 0

    def pids(self) -> list[int]:
        out = []
        for p in self.procs:
            out.append(p.pid)
            out += children(p.pid)
        return out


def start_nginx(name: str, conf: Path, work: Path, cpu: str) -> subprocess.Popen:
    p = spawn(name, [NGINX, "-p", str(work), "-e", str(work / f"{name}-error.log"), "-c", str(conf),
                     "-g", "daemon off;"], cpu, work / f"{name}.log")
    # Record the worker too, so a crash of this script cannot leave it behind.
    deadline = time.time() + 5
    while time.time() < deadline and not children(p.pid):
        time.sleep(0.05)
    for c in children(p.pid):
        EXTRA_PIDS.append((comm(c) or "nginx", c))
        record_pid("nginx", c)
    return p


def setup(work: Path) -> tuple[dict[str, Path_], subprocess.Popen, int]:
    (app_port, tg_port, tg_admin, ngx_port, env_port, env_admin) = free_ports(6)
    app = start_nginx("app", write_app_conf(work, app_port), work, GEN_CPU)
    wait_http(f"http://127.0.0.1:{app_port}/", app, "app nginx")
    paths: dict[str, Path_] = {}
    if "direct" in PATHS:
        paths["direct"] = Path_("direct", f"http://127.0.0.1:{app_port}/", [])
    if "tollgate" in PATHS:
        pol = work / "policy-per-ip.yaml"
        pol.write_text(POLICY_PER_IP)
        p = spawn("tollgate-sidecar", [SIDECAR_BIN, "--listen", f"127.0.0.1:{tg_port}",
                                       "--upstream", f"http://127.0.0.1:{app_port}",
                                       "--policies", str(pol), "--admin", f"127.0.0.1:{tg_admin}",
                                       "--log", "warn"], SUT_CPU, work / "tollgate.log")
        wait_http(f"http://127.0.0.1:{tg_admin}/readyz", p, "tollgate-sidecar")
        wait_http(f"http://127.0.0.1:{tg_port}/", p, "tollgate-sidecar proxy")
        paths["tollgate"] = Path_("tollgate", f"http://127.0.0.1:{tg_port}/", [p])
        paths["tollgate"].admin = f"http://127.0.0.1:{tg_admin}"
    if "nginx" in PATHS:
        p = start_nginx("nginx-proxy", write_nginx_proxy_conf(work, ngx_port, app_port), work,
                        SUT_CPU)
        wait_http(f"http://127.0.0.1:{ngx_port}/", p, "nginx proxy")
        paths["nginx"] = Path_("nginx", f"http://127.0.0.1:{ngx_port}/", [p])
    if "envoy" in PATHS:
        conf = write_envoy_conf(work, env_port, env_admin, app_port)
        p = spawn("envoy", [ENVOY, "-c", str(conf), "--concurrency", "1", "--log-level", "error",
                            "--disable-hot-restart", "--base-id", str(os.getpid() % 60000)],
                  SUT_CPU, work / "envoy.log")
        wait_http(f"http://127.0.0.1:{env_admin}/ready", p, "envoy", secs=30)
        wait_http(f"http://127.0.0.1:{env_port}/", p, "envoy proxy")
        paths["envoy"] = Path_("envoy", f"http://127.0.0.1:{env_port}/", [p])
    return paths, app, app_port


# ---------------------------------------------------------------------------------------------
# Load generators


def run_tool(argv: list[str], cpu: str, timeout: float) -> str:
    p = subprocess.Popen(prefix(cpu) + argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    STARTED.append((Path(argv[0]).name, p))
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        STARTED.remove((Path(argv[0]).name, p))
    if p.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({p.returncode}): {err.strip()[-500:]}")
    return out


def oha(url: str, rate: int, secs: int) -> dict:
    out = run_tool([OHA, "-q", str(rate), "-z", f"{secs}s", "-c", str(CONNS), "--no-tui",
                    "--latency-correction", "--output-format", "json", url], GEN_CPU, secs + 30)
    j = json.loads(out)
    codes = {str(k): int(v) for k, v in (j.get("statusCodeDistribution") or {}).items()}
    dist = {str(k): int(v) for k, v in (j.get("errorDistribution") or {}).items()}
    # Requests still in flight when -z ends are cancelled, not failed.
    errors = sum(v for k, v in dist.items() if "deadline" not in k.lower())
    lp = j["latencyPercentiles"]
    return {
        "p50_ms": lp["p50"] * 1e3,
        "p99_ms": lp["p99"] * 1e3,
        "rps": j["summary"]["requestsPerSec"],
        "completed": sum(codes.values()),
        "non2xx": sum(v for k, v in codes.items() if not k.startswith("2")),
        "errors": errors,
        "error_kinds": dist,
    }


def wrk(url: str, secs: int, conns: int, script: Path | None = None,
        script_args: list[str] | None = None) -> dict:
    argv = [WRK, "-t1", f"-c{conns}", f"-d{secs}s", "--timeout", "5s"]
    if script:
        argv += ["-s", str(script)]
    argv.append(url)
    if script_args:
        argv += ["--"] + script_args
    out = run_tool(argv, GEN_CPU, secs + 30)
    m = re.search(r"(\d+) requests in", out)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    return {
        "rps": float(rps.group(1)) if rps else 0.0,
        "completed": int(m.group(1)) if m else 0,
        "non2xx": int(non2xx.group(1)) if non2xx else 0,
        "errors": sum(int(x) for x in sock.groups()) if sock else 0,
    }


def measure(path: Path_, kind: str) -> dict:
    pids = path.pids()
    cpu0, busy0, t0 = proc_cpu_ticks(pids), core_busy_ticks(SUT_CPU), time.time()
    la = loadavg()
    if kind == "sat":
        r = wrk(path.url, SAT_SECS, SAT_CONNS)
    else:
        r = oha(path.url, int(kind), LOAD_SECS)
    cpu1, busy1, t1 = proc_cpu_ticks(pids), core_busy_ticks(SUT_CPU), time.time()
    sut_s = (cpu1 - cpu0) / CLK_TCK
    r["sut_cpu_s"] = sut_s
    r["cpu_us_per_req"] = (sut_s * 1e6 / r["completed"]) if (pids and r["completed"]) else None
    # Core-1 time not spent by the proxy under test: other processes, plus softirq work.
    r["foreign_core_pct"] = max(0.0, ((busy1 - busy0) / CLK_TCK - sut_s) / (t1 - t0) * 100)
    r["loadavg"] = la
    return r


def warm(path: Path_) -> None:
    oha(path.url, 1000, 1)


# ---------------------------------------------------------------------------------------------
# 100k keys


def keys_test(work: Path, app_port: int) -> dict:
    port, admin = free_ports(2)
    pol = work / "policy-keys.yaml"
    pol.write_text(POLICY_KEYS)
    lua = work / "keys.lua"
    lua.write_text(WRK_KEYS_LUA)
    p = spawn("tollgate-sidecar", [SIDECAR_BIN, "--listen", f"127.0.0.1:{port}",
                                   "--upstream", f"http://127.0.0.1:{app_port}",
                                   "--policies", str(pol), "--admin", f"127.0.0.1:{admin}",
                                   "--log", "warn"], SUT_CPU, work / "tollgate-keys.log")
    try:
        wait_http(f"http://127.0.0.1:{admin}/readyz", p, "tollgate-sidecar (keys)")
        wait_http(f"http://127.0.0.1:{port}/", p, "tollgate-sidecar (keys) proxy")
        time.sleep(0.5)
        idle = rss_kib([p.pid])
        sent = 0
        active = 0
        for _ in range(10):
            r = wrk(f"http://127.0.0.1:{port}/", 4, 16, lua, [str(sent), str(KEYS)])
            sent += r["completed"]
            active = active_keys(f"http://127.0.0.1:{admin}")
            if sent >= KEYS:
                break
        time.sleep(0.5)
        rss = rss_kib([p.pid])
        return {"rss_idle_kib": idle, "rss_kib": rss, "requests": sent,
                "active_keys": active_keys(f"http://127.0.0.1:{admin}"),
                "active_keys_during": active}
    finally:
        stop("tollgate-sidecar", p)
        STARTED.remove(("tollgate-sidecar", p))


def active_keys(admin: str) -> int:
    _, txt = http_get(f"{admin}/metrics")
    m = re.search(r"^tollgate_active_keys\s+(\d+)", txt, re.M)
    return int(m.group(1)) if m else -1


def tollgate_outcomes(admin: str) -> dict[str, int]:
    _, txt = http_get(f"{admin}/metrics")
    out: dict[str, int] = {}
    for m in re.finditer(r'^tollgate_requests_total\{([^}]*)\}\s+(\d+)', txt, re.M):
        o = re.search(r'(?:decision|outcome)="([^"]+)"', m.group(1))
        if o:
            out[o.group(1)] = out.get(o.group(1), 0) + int(m.group(2))
    return out


# ---------------------------------------------------------------------------------------------
# Statistics and report


def stats(vals: list[float]) -> dict | None:
    vals = [v for v in vals if v is not None]
    if not vals:
        return None
    return {"med": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def fmt(s: dict | None, digits: int = 3, unit: str = "") -> str:
    if not s:
        return "–"
    f = f"{{:.{digits}f}}"
    return f"{f.format(s['med'])}{unit} ({f.format(s['min'])}–{f.format(s['max'])})"


def summarize(runs: dict, paths: list[str]) -> dict:
    """runs[path][kind] = list of per-rep dicts (same order of reps for every path)."""
    S: dict = {}
    for p in paths:
        S[p] = {}
        for kind, reps in runs[p].items():
            d = {
                "p50": stats([r.get("p50_ms") for r in reps]),
                "p99": stats([r.get("p99_ms") for r in reps]),
                "rps": stats([r["rps"] for r in reps]),
                "cpu": stats([r["cpu_us_per_req"] for r in reps]),
                "foreign": stats([r["foreign_core_pct"] for r in reps]),
                "bad": sum(r["non2xx"] + r["errors"] for r in reps),
            }
            if p != "direct" and "direct" in runs and kind != "sat":
                base = runs["direct"][kind]
                d["add_p50"] = stats([r["p50_ms"] - b["p50_ms"] for r, b in zip(reps, base)])
                d["add_p99"] = stats([r["p99_ms"] - b["p99_ms"] for r, b in zip(reps, base)])
            S[p][kind] = d
    return S


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def goals(S: dict, mem: dict, keys: dict | None) -> list[dict]:
    G = []

    def med(p, kind, metric):
        try:
            return S[p][kind][metric]["med"]
        except (KeyError, TypeError):
            return None

    def add(gid, what, target_txt, ours, peer, bound, higher_better, unit, note=""):
        r = ratio(ours, peer)
        if r is None:
            verdict = "n/a"
        elif higher_better:
            verdict = "PASS" if r >= bound else "MISS"
        else:
            verdict = "PASS" if r <= bound else "MISS"
        G.append({"id": gid, "what": what, "target": target_txt, "ours": ours, "peer": peer,
                  "ratio": r, "bound": bound, "verdict": verdict, "unit": unit, "note": note,
                  "higher_better": higher_better})

    for rate in RATES:
        k = str(rate)
        for peer, bound in (("nginx", 0.8), ("envoy", 0.25)):
            add("G1", f"added p99 @ {rate} rps vs {peer}", f"≤ {bound}×",
                med("tollgate", k, "add_p99"), med(peer, k, "add_p99"), bound, False, "ms")
    k5 = str(max(RATES))
    add("G2", f"CPU µs/req @ {k5} rps vs nginx", "≤ 0.9×", med("tollgate", k5, "cpu"),
        med("nginx", k5, "cpu"), 0.9, False, "µs")
    add("G2", f"CPU µs/req @ {k5} rps vs Envoy", "≤ 0.25×", med("tollgate", k5, "cpu"),
        med("envoy", k5, "cpu"), 0.25, False, "µs", "extra (§4)")
    # Issue 19 (the proxy hop): CPU per admitted request with the proxy's core saturated.
    add("G2", "CPU µs/req at saturation vs nginx", "≤ 0.9×", med("tollgate", "sat", "cpu"),
        med("nginx", "sat", "cpu"), 0.9, False, "µs")
    add("G2", "CPU µs/req at saturation vs Envoy", "≤ 0.33×", med("tollgate", "sat", "cpu"),
        med("envoy", "sat", "cpu"), 0.33, False, "µs")
    add("G3", "saturation req/s vs nginx", "≥ 1.1×", med("tollgate", "sat", "rps"),
        med("nginx", "sat", "rps"), 1.1, True, "req/s")
    add("G3", "saturation req/s vs Envoy", "≥ 3×", med("tollgate", "sat", "rps"),
        med("envoy", "sat", "rps"), 3.0, True, "req/s")
    if keys:
        mb = keys["rss_kib"] / 1024
        G.append({"id": "G8", "what": f"RSS with {keys['active_keys']:,} active keys",
                  "target": "≤ 32 MB", "ours": mb, "peer": 32.0, "ratio": mb / 32.0,
                  "bound": 1.0, "verdict": "PASS" if mb <= 32.0 and keys["active_keys"] >= KEYS
                  else "MISS", "unit": "MB", "note": "", "higher_better": False})
    tg = mem.get("tollgate", {}).get("idle")
    for peer, bound in (("nginx", 1.2), ("envoy", 0.2)):
        pk = mem.get(peer, {}).get("idle")
        add("G8", f"RSS idle vs {peer}", f"≤ {bound}×", tg / 1024 if tg else None,
            pk / 1024 if pk else None, bound, False, "MB", "extra (§4)")
    return G


def svg_plot(S: dict, paths: list[str], out: Path, title: str) -> None:
    """Grouped bars: absolute p50 and p99 per path, one panel per rate, min–max whiskers."""
    W, H = 900, 420
    panel_w = (W - 80) / len(RATES)
    top, bottom = 60, H - 90
    vmax = 0.0
    for p in paths:
        for rate in RATES:
            for m in ("p50", "p99"):
                s = S[p][str(rate)][m]
                if s:
                    vmax = max(vmax, s["max"])
    vmax = vmax * 1.1 or 1.0
    # A round axis maximum.
    mag = 10 ** int(f"{vmax:e}".split("e")[1])
    for step in (1, 2, 2.5, 5, 10):
        if step * mag >= vmax:
            vmax = step * mag
            break

    def y(v: float) -> float:
        return bottom - (v / vmax) * (bottom - top)

    e = []
    e.append(f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
             f'font-family="sans-serif" font-size="12">')
    e.append(f'<rect width="{W}" height="{H}" fill="white"/>')
    e.append(f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="15">{title}</text>')
    e.append(f'<text x="{W / 2}" y="40" text-anchor="middle" fill="#555">latency (ms), median '
             f'of repetitions, whiskers min–max; solid = p50, hatched = p99</text>')
    e.append('<defs><pattern id="hatch" width="5" height="5" patternUnits="userSpaceOnUse" '
             'patternTransform="rotate(45)"><rect width="5" height="5" fill="white"/>'
             '<line x1="0" y1="0" x2="0" y2="5" stroke="black" stroke-width="2" '
             'stroke-opacity="0.35"/></pattern></defs>')
    for i in range(6):
        v = vmax * i / 5
        yy = y(v)
        e.append(f'<line x1="60" x2="{W - 20}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#eee"/>')
        e.append(f'<text x="55" y="{yy + 4:.1f}" text-anchor="end">{v:g}</text>')
    for ri, rate in enumerate(RATES):
        x0 = 60 + ri * panel_w
        e.append(f'<text x="{x0 + panel_w / 2:.1f}" y="{H - 60}" text-anchor="middle" '
                 f'font-weight="bold">{rate} rps, {CONNS} connections</text>')
        group_w = (panel_w - 40) / len(paths)
        for pi, p in enumerate(paths):
            gx = x0 + 20 + pi * group_w
            bw = group_w * 0.35
            for mi, m in enumerate(("p50", "p99")):
                s = S[p][str(rate)][m]
                if not s:
                    continue
                bx = gx + group_w * 0.12 + mi * bw
                fill = COLORS[p]
                e.append(f'<rect x="{bx:.1f}" y="{y(s["med"]):.1f}" width="{bw:.1f}" '
                         f'height="{bottom - y(s["med"]):.1f}" fill="{fill}"/>')
                if m == "p99":
                    e.append(f'<rect x="{bx:.1f}" y="{y(s["med"]):.1f}" width="{bw:.1f}" '
                             f'height="{bottom - y(s["med"]):.1f}" fill="url(#hatch)" '
                             f'fill-opacity="0.5"/>')
                cx = bx + bw / 2
                e.append(f'<line x1="{cx:.1f}" x2="{cx:.1f}" y1="{y(s["min"]):.1f}" '
                         f'y2="{y(s["max"]):.1f}" stroke="black"/>')
                for v in (s["min"], s["max"]):
                    e.append(f'<line x1="{cx - 4:.1f}" x2="{cx + 4:.1f}" y1="{y(v):.1f}" '
                             f'y2="{y(v):.1f}" stroke="black"/>')
                e.append(f'<text x="{cx:.1f}" y="{y(s["max"]) - 4:.1f}" text-anchor="middle" '
                         f'font-size="10">{s["med"]:.2f}</text>')
            e.append(f'<text x="{gx + group_w * 0.47:.1f}" y="{bottom + 15}" '
                     f'text-anchor="middle" font-size="11">{p}</text>')
    e.append(f'<line x1="60" x2="{W - 20}" y1="{bottom}" y2="{bottom}" stroke="black"/>')
    lx = 70
    for p in paths:
        e.append(f'<rect x="{lx}" y="{H - 35}" width="12" height="12" fill="{COLORS[p]}"/>')
        e.append(f'<text x="{lx + 16}" y="{H - 25}">{LABELS[p]}</text>')
        lx += 30 + 7 * len(LABELS[p])
    e.append("</svg>")
    out.write_text("\n".join(e) + "\n")


def report(S: dict, paths: list[str], mem: dict, keys: dict | None, G: list[dict], meta: dict,
           outcomes: dict) -> str:
    L = []
    L.append(f"# tollgate proxy benchmark — {meta['date']}{' (QUICK)' if QUICK else ''}")
    L.append("")
    L.append(f"Command: `{meta['command']}` · {REPS} interleaved repetitions "
             f"(order {' '.join(paths)} per measurement) · oha open loop `-q RATE -z {LOAD_SECS}s "
             f"-c {CONNS} --latency-correction` · saturation `wrk -t1 -c{SAT_CONNS} -d{SAT_SECS}s` · "
             f"proxies on CPU {SUT_CPU}, load generator and app on CPU {GEN_CPU}"
             f"{sched_text()}.")
    L.append("")
    L.append("Values are `median (min–max)` over repetitions. *Added* latency is the per-repetition "
             "difference to the direct run of the same repetition.")
    L.append("")
    L.append("## Latency (ms)")
    L.append("")
    L.append("| path | rate | p50 | p99 | added p50 | added p99 | achieved rps | non-2xx/errors |")
    L.append("|---|---|---|---|---|---|---|---|")
    for rate in RATES:
        for p in paths:
            d = S[p][str(rate)]
            L.append(f"| {LABELS[p]} | {rate} | {fmt(d['p50'])} | {fmt(d['p99'])} | "
                     f"{fmt(d.get('add_p50')) if p != 'direct' else '–'} | "
                     f"{fmt(d.get('add_p99')) if p != 'direct' else '–'} | "
                     f"{fmt(d['rps'], 0)} | {d['bad']} |")
    L.append("")
    L.append("## Cost and capacity")
    L.append("")
    cols = " | ".join(f"CPU µs/req @ {r}" for r in RATES)
    L.append(f"| path | {cols} | CPU µs/req @ sat | saturation req/s | RSS idle MB | "
             "RSS after load MB |")
    L.append("|---|" + "---|" * (len(RATES) + 4))
    for p in paths:
        cpus = " | ".join(fmt(S[p][str(r)]["cpu"], 1) for r in RATES)
        m = mem.get(p, {})
        idle = f"{m['idle'] / 1024:.1f}" if m.get("idle") else "–"
        after = f"{m['after'] / 1024:.1f}" if m.get("after") else "–"
        L.append(f"| {LABELS[p]} | {cpus} | {fmt(S[p]['sat']['cpu'], 1)} | "
                 f"{fmt(S[p]['sat']['rps'], 0)} | {idle} | {after} |")
    L.append("")
    if keys:
        L.append(f"tollgate-sidecar with many keys (header-keyed Local token bucket, "
                 f"{keys['requests']:,} requests over {KEYS:,} distinct keys): "
                 f"**{keys['active_keys']:,} active keys, VmRSS {keys['rss_kib'] / 1024:.1f} MB** "
                 f"(fresh process idle {keys['rss_idle_kib'] / 1024:.1f} MB, so "
                 f"~{(keys['rss_kib'] - keys['rss_idle_kib']) * 1024 / max(keys['active_keys'], 1):.0f}"
                 f" B per key).")
        L.append("")
    if outcomes:
        L.append("tollgate decisions during the run (from /metrics): " +
                 ", ".join(f"{k} {v:,}" for k, v in sorted(outcomes.items())) + ".")
        L.append("")
    L.append("## Goals (ratios against peers measured in this run)")
    L.append("")
    L.append("| goal | metric | target | tollgate | peer | ratio | verdict |")
    L.append("|---|---|---|---|---|---|---|")
    for g in G:
        ours = f"{g['ours']:.3f} {g['unit']}" if g["ours"] is not None else "–"
        peer = f"{g['peer']:.3f} {g['unit']}" if g["peer"] is not None else "–"
        if g["unit"] == "req/s":
            ours = f"{g['ours']:,.0f}" if g["ours"] is not None else "–"
            peer = f"{g['peer']:,.0f}" if g["peer"] is not None else "–"
        r = f"{g['ratio']:.2f}×" if g["ratio"] is not None else "n/a"
        note = f" ({g['note']})" if g["note"] else ""
        L.append(f"| {g['id']} | {g['what']}{note} | {g['target']} | {ours} | {peer} | {r} | "
                 f"**{g['verdict']}** |")
    L.append("")
    L.append("## Noise")
    L.append("")
    fo = ", ".join(f"{p} {fmt(S[p]['sat']['foreign'], 0)}" for p in paths)
    L.append(f"- Core-{SUT_CPU} time not used by the proxy under test during saturation runs "
             f"(other processes + softirq), %: {fo}.")
    fo = ", ".join(f"{p} {fmt(S[p][str(max(RATES))]['foreign'], 0)}" for p in paths)
    L.append(f"- Same during the {max(RATES)} rps runs, %: {fo}.")
    L.append(f"- Load average: {meta['load_before']} before, {meta['load_after']} after.")
    L.append("- Threads of each proxy (all processes): " + ", ".join(
        f"{p} {mem[p]['threads']}" for p in paths if p in mem) + ".")
    L.append(f"- Busiest other processes at start: {'; '.join(meta['foreign_before'])}.")
    L.append(f"- Busiest other processes at end: {'; '.join(meta['foreign_after'])}.")
    L.append("")
    L.append("## Environment")
    L.append("")
    for k in ("host", "sidecar", "nginx", "envoy", "oha", "wrk", "duration"):
        L.append(f"- {k}: {meta[k]}")
    L.append("")
    return "\n".join(L)


# ---------------------------------------------------------------------------------------------


def main() -> int:
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    t_start = time.time()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tollgate-bench-"))
    meta = {
        "date": dt.datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
        "command": os.environ.get("BENCH_COMMAND", "bench/proxy.sh"),
        "host": f"{platform.node()} · {platform.platform()} · {os.cpu_count()} CPUs · "
                f"{cpu_model()}",
        "sidecar": f"{os.environ.get('SIDECAR_SOURCE', SIDECAR_BIN)} @ {git_rev()}",
        "nginx": tool_version([NGINX, "-v"]),
        "envoy": tool_version([ENVOY, "--version"]).replace(ENVOY, "envoy"),
        "oha": tool_version([OHA, "--version"]),
        "wrk": tool_version([WRK, "-v"]),
        "load_before": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
        "foreign_before": busiest_foreign(),
    }
    log(f"work dir {work}; {REPS} reps, {LOAD_SECS}s open-loop runs at {RATES} rps, "
        f"{SAT_SECS}s saturation, paths {PATHS}")
    try:
        paths, app, app_port = setup(work)
        order = [p for p in PATHS if p in paths]
        mem: dict = {}
        for p in order:
            warm(paths[p])
            pids = paths[p].pids()
            if pids:
                mem[p] = {"idle": rss_kib(pids), "threads": threads(pids)}
        kinds = [str(r) for r in RATES] + ["sat"]
        runs = {p: {k: [] for k in kinds} for p in order}
        for rep in range(REPS):
            for kind in kinds:
                for p in order:
                    r = measure(paths[p], kind)
                    runs[p][kind].append(r)
                    extra = (f"p50 {r['p50_ms']:.3f} p99 {r['p99_ms']:.3f} ms"
                             if "p50_ms" in r else f"{r['rps']:.0f} req/s")
                    cpu = (f", {r['cpu_us_per_req']:.1f} µs/req"
                           if r["cpu_us_per_req"] is not None else "")
                    log(f"rep {rep + 1}/{REPS} {kind:>4} {p:<8} {extra}{cpu}, "
                        f"{r['completed']} done, bad {r['non2xx'] + r['errors']}, "
                        f"foreign core {r['foreign_core_pct']:.0f}%")
                    time.sleep(0.3)
        for p in order:
            pids = paths[p].pids()
            if pids:
                mem[p]["after"] = rss_kib(pids)
        outcomes = {}
        if "tollgate" in paths:
            outcomes = tollgate_outcomes(paths["tollgate"].admin)
        # Free the CPU for the keys test: stop the proxies, keep the app.
        for p in order:
            for proc in paths[p].procs:
                stop(p, proc)
        keys = None
        if "tollgate" in PATHS and KEYS > 0:
            log(f"driving {KEYS:,} distinct keys through a header-keyed rule")
            keys = keys_test(work, app_port)
            log(f"{keys['active_keys']:,} active keys: VmRSS {keys['rss_kib'] / 1024:.1f} MB")
        meta["load_after"] = " ".join(Path("/proc/loadavg").read_text().split()[:3])
        meta["foreign_after"] = busiest_foreign()
        meta["duration"] = f"{time.time() - t_start:.0f} s"
        S = summarize(runs, order)
        G = goals(S, mem, keys)
        md = report(S, order, mem, keys, G, meta, outcomes)
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        suffix = "-quick" if QUICK else ""
        md_path = OUT_DIR / f"proxy-{stamp}{suffix}.md"
        md_path.write_text(md)
        (OUT_DIR / f"proxy-{stamp}{suffix}.json").write_text(json.dumps(
            {"meta": meta, "config": {"reps": REPS, "load_secs": LOAD_SECS,
                                      "sat_secs": SAT_SECS, "rates": RATES, "conns": CONNS,
                                      "sat_conns": SAT_CONNS, "nice": NICE, "quick": QUICK},
             "runs": runs, "summary": S, "memory_kib": mem, "keys": keys, "goals": G,
             "tollgate_outcomes": outcomes}, indent=1))
        svg_plot(S, order, OUT_DIR / "proxy-latency.svg",
                 f"Latency per path (direct = baseline), open loop — {meta['date']}"
                 f"{' (QUICK)' if QUICK else ''}")
        print(md)
        log(f"wrote {md_path.relative_to(ROOT) if md_path.is_relative_to(ROOT) else md_path}, "
            f"{(OUT_DIR / 'proxy-latency.svg')}")
        return 0
    finally:
        cleanup()
        for f in sorted(work.rglob("*"), reverse=True):
            try:
                f.unlink() if f.is_file() else f.rmdir()
            except OSError:
                pass
        try:
            work.rmdir()
        except OSError:
            pass


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "crates"],
                               capture_output=True, text=True).stdout.strip()
        return f"{rev or 'no commit'}{' + uncommitted changes in crates/' if dirty else ''}"
    except OSError:
        return "?"


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        cleanup()
        sys.exit(130)
