#!/usr/bin/env python3
"""Gateway benchmark: Envoy's rate limit protocols served by tollgate vs envoyproxy/ratelimit.

Normally started by bench/gateway.sh, which installs the tools, builds the peers
(tools/peers/build.sh) and passes their paths in the environment (ENVOY, RATELIMIT_BIN, VEGETA,
SIDECAR_BIN, NGINX, REDIS_SERVER, REDIS_CLI). See bench/README.md ("gateway").

Paths, all through the same Envoy binary (--concurrency 1) to the same app (nginx `return 200`):
  baseline       Envoy, no limiter                                              the baseline
  ratelimit      Envoy + envoy.filters.http.ratelimit -> envoyproxy/ratelimit -> Redis
  tollgate-rls   Envoy + envoy.filters.http.ratelimit -> tollgate-ratelimit
  tollgate-rlqs  Envoy + envoy.filters.http.rate_limit_quota -> the same tollgate process (RLQS)

Phases (each starts its own limit services and Envoys; the app and the Redis servers stay):
  main      limit 1e6/s (never binds): open-loop latency at each of RATES, paths interleaved
            (A B C D A B C D ...) for REPS repetitions, CPU per request of every process; then
            one run per limiter path with `redis-cli MONITOR` counting Redis commands
  accuracy  limit 1000/s, 2000 req/s offered for 10 s on one key: admitted vs the limit
  slow      every limiter reaches its Redis through a userspace relay that delays each
            request to Redis by 50 ms: hot-key latency, paths interleaved

Envoy, the limit services and Redis run on SUT_CPU; vegeta, the app and the relays on GEN_CPU.
Only the Python standard library is used (process helpers come from bench/proxy_bench.py);
the SVG plot is written by hand.

`python3 bench/gateway_bench.py relay LISTEN_PORT TARGET_PORT DELAY_MS` runs the delay relay
on its own; `python3 bench/gateway_bench.py configs DIR` writes every Envoy config and policy
and validates the Envoy configs with `envoy --mode validate`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import math
import os
import platform
import re
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proxy_bench as pb  # noqa: E402  (process bookkeeping, pinning, /proc readers, stats)

ROOT = pb.ROOT
CLK_TCK = pb.CLK_TCK
QUICK = pb.QUICK
env_int = pb.env_int

REPS = env_int("REPS", 3 if QUICK else 5)
LOAD_SECS = env_int("LOAD_SECS", 3 if QUICK else 8)
RATES = [int(r) for r in os.environ.get("RATES", "1000,5000").split(",") if r]
CONNS = env_int("CONNS", 16)              # vegeta's initial workers and keep-alive connections
# vegeta opens more connections when all are busy (0 = no cap), so a slow path gets queueing
# in the path, not in the load generator (16 connections carry at most 800 req/s at 20 ms).
MAX_CONNS = env_int("MAX_CONNS", 0)
KEYS = env_int("KEYS", 1)                  # distinct x-api-key values in the main runs
LIMIT = env_int("LIMIT", 1_000_000)        # per second, main and slow phases (never binds)
ACC_LIMIT = env_int("ACC_LIMIT", 1000)     # per second, accuracy phase
ACC_RATE = env_int("ACC_RATE", 2000)
ACC_SECS = env_int("ACC_SECS", 5 if QUICK else 10)
# RLQS: Envoy 1.40 reports usage every 5 s whatever reporting_interval says (the first request
# of a new bucket reports at once), and no_assignment_behavior (ALLOW_ALL here) holds until the
# first assignment. So the accuracy key is loaded at ACC_RATE for this long (>= 2 reports,
# >= 11 s) before the measured run, which then continues on the same bucket.
RLQS_WARM_SECS = env_int("RLQS_WARM_SECS", 12)
COUNT_RATE = env_int("COUNT_RATE", 1000)   # the MONITOR run
COUNT_SECS = env_int("COUNT_SECS", LOAD_SECS)
SLOW_MS = env_int("SLOW_MS", 50)
SLOW_RATE = env_int("SLOW_RATE", 1000)
SLOW_REPS = env_int("SLOW_REPS", REPS)
TIMEOUT_MS = env_int("TIMEOUT_MS", 20)     # Envoy's ratelimit filter timeout (both RLS paths)
ALL_PATHS = ["baseline", "ratelimit", "tollgate-rls", "tollgate-rlqs"]
PATHS = [p for p in os.environ.get("PATHS", ",".join(ALL_PATHS)).split(",") if p]
PHASES = [p for p in os.environ.get("PHASES", "main,accuracy,slow").split(",") if p]
SUT_CPU, GEN_CPU = pb.SUT_CPU, pb.GEN_CPU
OUT_DIR = Path(os.environ.get("OUT_DIR", str(ROOT / "bench/results")))

SIDECAR_BIN = os.environ.get("SIDECAR_BIN", str(ROOT / "target/release/tollgate-sidecar"))
# The rate limit service: its own binary, next to the sidecar.
TOLLGATE_RLS_BIN = str(Path(SIDECAR_BIN).with_name("tollgate-ratelimit"))
RATELIMIT_BIN = os.environ.get("RATELIMIT_BIN", "ratelimit")
VEGETA = os.environ.get("VEGETA", "vegeta")
ENVOY = pb.ENVOY
NGINX = pb.NGINX
REDIS_SERVER = os.environ.get("REDIS_SERVER", "redis-server")
REDIS_CLI = os.environ.get("REDIS_CLI", "redis-cli")

LABELS = {
    "baseline": "Envoy, no limiter",
    "ratelimit": "Envoy + ratelimit filter → envoyproxy/ratelimit",
    "tollgate-rls": "Envoy + ratelimit filter → tollgate (RLS v3)",
    "tollgate-rlqs": "Envoy + rate_limit_quota → tollgate (RLQS)",
}
SHORT = {"baseline": "baseline", "ratelimit": "envoyproxy/ratelimit",
         "tollgate-rls": "tollgate RLS", "tollgate-rlqs": "tollgate RLQS"}
AXIS = {"baseline": "baseline", "ratelimit": "ratelimit", "tollgate-rls": "tollgate RLS",
        "tollgate-rlqs": "tollgate RLQS"}
COLORS = {"baseline": "#888888", "ratelimit": "#d62728", "tollgate-rls": "#1f77b4",
          "tollgate-rlqs": "#17becf"}
# Which limit service (and Redis) a path uses.
SERVICE = {"baseline": None, "ratelimit": "ratelimit", "tollgate-rls": "tollgate",
           "tollgate-rlqs": "tollgate"}

log = pb.log

# ---------------------------------------------------------------------------------------------
# Configurations


def ratelimit_config(limit: int) -> str:
    return f"""domain: bench
descriptors:
  - key: api_key
    rate_limit:
      unit: second
      requests_per_unit: {limit}
"""


def tollgate_policy(limit: int) -> str:
    return f"""# bench/gateway_bench.py: one bucket per api_key descriptor value (Envoy's x-api-key).
apiVersion: tollgate.dev/v1alpha1
kind: RateLimitPolicy
metadata:
  name: bench
  namespace: default
spec:
  targetRef:
    selector: {{}}
  rules:
    - name: per-key
      scope: Global
      failureMode: Open
      match:
        descriptors:
          - key: api_key
      key:
        - descriptor: api_key
      limit:
        requests: {limit}
        period: 1s
"""


def envoy_config(kind: str, port: int, admin_port: int, app_port: int,
                 rls_port: int | None) -> str:
    """kind: none (no limiter), rls (envoy.filters.http.ratelimit), rlqs (rate_limit_quota)."""
    filters = ""
    rate_limits = ""
    rls_cluster = ""
    if kind == "rls":
        filters = f"""
          - name: envoy.filters.http.ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
              domain: bench
              failure_mode_deny: false
              timeout: {TIMEOUT_MS / 1000:g}s
              rate_limit_service:
                grpc_service: {{envoy_grpc: {{cluster_name: rls}}}}
                transport_api_version: V3"""
        rate_limits = """
                  rate_limits:
                  - actions:
                    - request_headers: {header_name: x-api-key, descriptor_key: api_key}"""
    elif kind == "rlqs":
        filters = """
          - name: envoy.filters.http.rate_limit_quota
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaFilterConfig
              rlqs_server: {envoy_grpc: {cluster_name: rls}}
              domain: bench
              bucket_matchers:
                on_no_match:
                  action:
                    name: rate_limit_quota_bucket_settings
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaBucketSettings
                      bucket_id_builder:
                        bucket_id_builder:
                          name: {string_value: per-key}
                          api_key:
                            custom_value:
                              name: api_key
                              typed_config:
                                "@type": type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput
                                header_name: x-api-key
                      reporting_interval: 1s
                      deny_response_settings:
                        http_status: {code: TooManyRequests}
                      no_assignment_behavior:
                        fallback_rate_limit: {blanket_rule: ALLOW_ALL}
                      expired_assignment_behavior:
                        expired_assignment_behavior_timeout: 60s
                        fallback_rate_limit: {blanket_rule: ALLOW_ALL}"""
    elif kind != "none":
        raise ValueError(kind)
    if rls_port is not None:
        rls_cluster = f"""
  - name: rls
    connect_timeout: 1s
    type: STATIC
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http2_protocol_options: {{}}
    load_assignment:
      cluster_name: rls
      endpoints:
      - lb_endpoints:
        - endpoint:
            address: {{socket_address: {{address: 127.0.0.1, port_value: {rls_port}}}}}"""
    return f"""# bench/gateway_bench.py: {kind}
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
                route:
                  cluster: app{rate_limits}
          http_filters:{filters}
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
            address: {{socket_address: {{address: 127.0.0.1, port_value: {app_port}}}}}{rls_cluster}
"""


ENVOY_KIND = {"baseline": "none", "ratelimit": "rls", "tollgate-rls": "rls",
              "tollgate-rlqs": "rlqs"}


def validate_envoy(conf: Path) -> None:
    r = subprocess.run([ENVOY, "--mode", "validate", "-c", str(conf), "--log-level", "error",
                        "--disable-hot-restart"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"envoy --mode validate {conf.name} failed:\n{r.stdout}{r.stderr}")


# ---------------------------------------------------------------------------------------------
# The delay relay (slow Redis): client -> server bytes are held for DELAY_MS, server -> client
# bytes pass at once, so every Redis round trip takes DELAY_MS longer while pipelined commands
# keep their order and overlap.


async def _relay(listen: int, target: int, delay_s: float) -> None:
    loop = asyncio.get_running_loop()

    def nodelay(w: asyncio.StreamWriter) -> None:
        s = w.get_extra_info("socket")
        if s is not None:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, delay: float) -> None:
        q: asyncio.Queue = asyncio.Queue()

        async def sender() -> None:
            try:
                while True:
                    due, data = await q.get()
                    if data is None:
                        break
                    wait = due - loop.time()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    w.write(data)
                    await w.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                w.close()

        t = loop.create_task(sender()) if delay > 0 else None
        try:
            while True:
                data = await r.read(65536)
                if not data:
                    break
                if t is None:
                    w.write(data)
                    await w.drain()
                else:
                    q.put_nowait((loop.time() + delay, data))
        except (ConnectionError, OSError):
            pass
        finally:
            if t is None:
                w.close()
            else:
                q.put_nowait((0.0, None))
                await t

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            sr, sw = await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            cw.close()
            return
        nodelay(cw)
        nodelay(sw)
        await asyncio.gather(pipe(cr, sw, delay_s), pipe(sr, cw, 0.0))

    server = await asyncio.start_server(handle, "127.0.0.1", listen, backlog=1024)
    async with server:
        await server.serve_forever()


def relay_main(argv: list[str]) -> int:
    listen, target, delay_ms = int(argv[0]), int(argv[1]), float(argv[2])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    asyncio.run(_relay(listen, target, delay_ms / 1000))
    return 0


# ---------------------------------------------------------------------------------------------
# Processes


def wait_tcp(port: int, proc: subprocess.Popen, what: str, secs: float = 20.0) -> None:
    deadline = time.time() + secs
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} during startup")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} not listening on {port}")


def redis_cmd(port: int, *args: str) -> str:
    return subprocess.run([REDIS_CLI, "-p", str(port), *args], capture_output=True, text=True,
                          timeout=10).stdout.strip()


def start_redis(work: Path, name: str) -> tuple[subprocess.Popen, int]:
    (port,) = pb.free_ports(1)
    d = work / name
    d.mkdir(exist_ok=True)
    p = pb.spawn(name, [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1",
                        "--save", "", "--appendonly", "no", "--dir", str(d),
                        "--daemonize", "no", "--logfile", ""],
                 SUT_CPU, work / f"{name}.log")
    wait_tcp(port, p, name)
    deadline = time.time() + 10
    while redis_cmd(port, "ping") != "PONG":
        if time.time() > deadline:
            raise RuntimeError(f"{name} does not answer PING")
        time.sleep(0.05)
    return p, port


class Service:
    """A limit service process: envoyproxy/ratelimit or tollgate-ratelimit."""

    def __init__(self, name: str, proc: subprocess.Popen, grpc_port: int, redis_pid: int,
                 admin: str | None = None):
        self.name, self.proc, self.grpc_port = name, proc, grpc_port
        self.redis_pid = redis_pid
        self.admin = admin


def start_ratelimit(work: Path, tag: str, limit: int, redis_port: int,
                    redis_pid: int) -> Service:
    grpc, http, debug = pb.free_ports(3)
    rt = work / f"ratelimit-{tag}"
    (rt / "config").mkdir(parents=True, exist_ok=True)
    (rt / "config" / "bench.yaml").write_text(ratelimit_config(limit))
    env = dict(os.environ, REDIS_SOCKET_TYPE="tcp", REDIS_URL=f"127.0.0.1:{redis_port}",
               USE_STATSD="false", RUNTIME_ROOT=str(rt), RUNTIME_SUBDIRECTORY=".",
               RUNTIME_WATCH_ROOT="false", HOST="127.0.0.1", PORT=str(http),
               GRPC_HOST="127.0.0.1", GRPC_PORT=str(grpc), DEBUG_HOST="127.0.0.1",
               DEBUG_PORT=str(debug), LOG_LEVEL="warn")
    p = spawn_env("ratelimit", [RATELIMIT_BIN], SUT_CPU, work / f"ratelimit-{tag}.log", env)
    pb.wait_http(f"http://127.0.0.1:{http}/healthcheck", p, "envoyproxy/ratelimit")
    wait_tcp(grpc, p, "envoyproxy/ratelimit gRPC")
    return Service("ratelimit", p, grpc, redis_pid)


def start_tollgate(work: Path, tag: str, limit: int, redis_port: int, redis_pid: int) -> Service:
    port, admin = pb.free_ports(2)
    pol = work / f"policy-{tag}.yaml"
    pol.write_text(tollgate_policy(limit))
    p = pb.spawn("tollgate-ratelimit", [TOLLGATE_RLS_BIN,
                                        "--listen", f"127.0.0.1:{port}",
                                        "--admin", f"127.0.0.1:{admin}", "--policies", str(pol),
                                        "--redis", f"redis://127.0.0.1:{redis_port}",
                                        "--log", "warn"], SUT_CPU, work / f"tollgate-{tag}.log")
    pb.wait_http(f"http://127.0.0.1:{admin}/readyz", p, "tollgate-ratelimit")
    wait_tcp(port, p, "tollgate-ratelimit gRPC")
    return Service("tollgate", p, port, redis_pid, f"http://127.0.0.1:{admin}")


def spawn_env(name: str, argv: list[str], cpu: str, logfile: Path,
              env: dict) -> subprocess.Popen:
    out = open(logfile, "ab")
    p = subprocess.Popen(pb.prefix(cpu) + argv, stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                         start_new_session=True, env=env)
    pb.STARTED.append((name, p))
    pb.record_pid(Path(argv[0]).name, p.pid)
    return p


class GwPath:
    def __init__(self, name: str, url: str, envoy: subprocess.Popen, admin: str,
                 service: Service | None):
        self.name, self.url, self.envoy, self.admin, self.service = (name, url, envoy, admin,
                                                                     service)


def start_envoy(work: Path, tag: str, path: str, app_port: int,
                service: Service | None) -> GwPath:
    port, admin = pb.free_ports(2)
    conf = work / f"envoy-{path}-{tag}.yaml"
    conf.write_text(envoy_config(ENVOY_KIND[path], port, admin, app_port,
                                 service.grpc_port if service else None))
    validate_envoy(conf)
    base_id = (os.getpid() * 8 + ALL_PATHS.index(path)) % 60000
    p = pb.spawn(f"envoy-{path}", [ENVOY, "-c", str(conf), "--concurrency", "1",
                                   "--log-level", "error", "--disable-hot-restart",
                                   "--base-id", str(base_id)],
                 SUT_CPU, work / f"envoy-{path}-{tag}.log")
    pb.wait_http(f"http://127.0.0.1:{admin}/ready", p, f"envoy ({path})", secs=30)
    pb.wait_http(f"http://127.0.0.1:{port}/", p, f"envoy ({path}) listener")
    return GwPath(path, f"http://127.0.0.1:{port}/", p, f"http://127.0.0.1:{admin}", service)


def stop_procs(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        for i, (name, q) in enumerate(list(pb.STARTED)):
            if q is p:
                pb.stop(name, q)
                pb.STARTED.remove((name, q))
                break


class Stack:
    """One phase's limit services and Envoys."""

    def __init__(self, work: Path, tag: str, limit: int, app_port: int,
                 redis: dict[str, tuple[int, int]], relays: dict[str, int] | None = None):
        """redis[svc] = (pid, port); relays[svc] = port to use instead of Redis's own."""
        self.services: dict[str, Service] = {}
        self.paths: dict[str, GwPath] = {}
        for svc in sorted({SERVICE[p] for p in PATHS if SERVICE[p]}):
            rpid, rport = redis[svc]
            port = (relays or {}).get(svc, rport)
            if svc == "ratelimit":
                self.services[svc] = start_ratelimit(work, tag, limit, port, rpid)
            else:
                self.services[svc] = start_tollgate(work, tag, limit, port, rpid)
        for p in PATHS:
            svc = SERVICE[p]
            self.paths[p] = start_envoy(work, tag, p, app_port,
                                        self.services[svc] if svc else None)

    def stop(self) -> None:
        stop_procs([gp.envoy for gp in self.paths.values()])
        stop_procs([s.proc for s in self.services.values()])


# ---------------------------------------------------------------------------------------------
# Load


def targets_file(work: Path, url: str, keys: list[str]) -> Path:
    f = work / f"targets-{abs(hash((url, tuple(keys))))}.txt"
    f.write_text("".join(f"GET {url}\nx-api-key: {k}\n\n" for k in keys))
    return f


def attack(work: Path, url: str, rate: int, secs: float, keys: list[str]) -> dict:
    """Open-loop vegeta run; latency from when a worker sends (workers are added as needed, so
    a slow response never delays the next send)."""
    out = work / "attack.bin"
    tf = targets_file(work, url, keys)
    ru0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.time()
    pb.run_tool([VEGETA, "attack", "-rate", f"{rate}/1s", "-duration", f"{secs}s",
                 "-targets", str(tf), "-workers", str(CONNS), "-connections", "10000",
                 "-max-connections", str(MAX_CONNS), "-timeout", "10s", "-http2=false",
                 "-output", str(out)], GEN_CPU, secs + 60)
    ru1, t1 = resource.getrusage(resource.RUSAGE_CHILDREN), time.time()
    # vegeta's own share of its CPU: near 100 % its sends would come late.
    gen_pct = ((ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)) / (t1 - t0) * 100
    rep = subprocess.run([VEGETA, "report", "-type=json", str(out)], capture_output=True,
                         text=True, timeout=120)
    j = json.loads(rep.stdout)
    codes = {str(k): int(v) for k, v in (j.get("status_codes") or {}).items()}
    lat = j["latencies"]
    return {
        "p50_ms": lat["50th"] / 1e6,
        "p90_ms": lat["90th"] / 1e6,
        "p99_ms": lat["99th"] / 1e6,
        "max_ms": lat["max"] / 1e6,
        "rps": j.get("throughput") or 0.0,
        "requests": int(j.get("requests") or 0),
        "completed": sum(v for k, v in codes.items() if k != "0"),
        "ok": codes.get("200", 0),
        "rejected": codes.get("429", 0),
        "non2xx": sum(v for k, v in codes.items() if k not in ("200", "0")),
        "errors": codes.get("0", 0),
        "status_codes": codes,
        "error_kinds": (j.get("errors") or [])[:5],
        "vegeta_cpu_pct": gen_pct,
    }


def pids_of(gp: GwPath) -> dict[str, list[int]]:
    d = {"envoy": [gp.envoy.pid]}
    if gp.service:
        d["limiter"] = [gp.service.proc.pid]
        d["redis"] = [gp.service.redis_pid]
    return d


def measure(work: Path, gp: GwPath, rate: int, secs: float, keys: list[str]) -> dict:
    groups = pids_of(gp)
    all_pids = [p for v in groups.values() for p in v]
    c0 = {g: pb.proc_cpu_ticks(v) for g, v in groups.items()}
    busy0, t0 = pb.core_busy_ticks(SUT_CPU), time.time()
    r = attack(work, gp.url, rate, secs, keys)
    busy1, t1 = pb.core_busy_ticks(SUT_CPU), time.time()
    c1 = {g: pb.proc_cpu_ticks(v) for g, v in groups.items()}
    n = r["completed"]
    for g in ("envoy", "limiter", "redis"):
        if g in groups and n:
            r[f"{g}_cpu_us_per_req"] = (c1[g] - c0[g]) / CLK_TCK * 1e6 / n
        else:
            r[f"{g}_cpu_us_per_req"] = None
    ours = sum(c1[g] - c0[g] for g in groups) / CLK_TCK
    # Other processes' share of the SUT core (the other paths' idle Envoys count as foreign).
    r["foreign_core_pct"] = max(0.0, ((busy1 - busy0) / CLK_TCK - ours) / (t1 - t0) * 100)
    r["loadavg"] = pb.loadavg()
    del all_pids
    return r


def warm(work: Path, gp: GwPath, keys: list[str], secs: float = 1.0) -> None:
    attack(work, gp.url, 500, secs, keys)


def envoy_limiter_stats(gp: GwPath) -> dict[str, int]:
    """Envoy's counters of the limit filter (ok, over_limit, error, failure_mode_allowed, ...)."""
    try:
        _, txt = pb.http_get(f"{gp.admin}/stats?filter=ratelimit|rate_limit_quota|rlqs",
                             timeout=3)
    except Exception:  # noqa: BLE001
        return {}
    out = {}
    for line in txt.splitlines():
        m = re.match(r"^(\S+): (\d+)$", line)
        if m and int(m.group(2)):
            out[m.group(1)] = int(m.group(2))
    return out


def count_redis(work: Path, gp: GwPath, redis_port: int, rate: int, secs: float,
                keys: list[str]) -> dict:
    """Client-issued Redis commands during one open-loop run, from `redis-cli MONITOR`."""
    mon_log = work / f"monitor-{gp.name}.txt"
    mon_log.unlink(missing_ok=True)
    mon = subprocess.Popen(pb.prefix(GEN_CPU) + [REDIS_CLI, "-p", str(redis_port), "monitor"],
                           stdout=open(mon_log, "wb"), stderr=subprocess.DEVNULL,
                           stdin=subprocess.DEVNULL, start_new_session=True)
    pb.STARTED.append(("redis-cli", mon))
    pb.record_pid("redis-cli", mon.pid)
    # MONITOR is on once its OK has arrived.
    deadline = time.time() + 5
    while time.time() < deadline and mon_log.stat().st_size == 0:
        time.sleep(0.02)
    r = attack(work, gp.url, rate, secs, keys)
    time.sleep(0.2)
    stop_procs([mon])
    cmds: dict[str, int] = {}
    total = lua = 0
    for line in mon_log.read_text(errors="replace").splitlines():
        m = re.match(r'^\d+\.\d+ \[\d+ ([^\]]+)\] "([^"]+)"', line)
        if not m:
            continue  # the MONITOR's own OK
        if m.group(1) == "lua":
            lua += 1  # a command run by a script: the script call counted once already
            continue
        total += 1
        c = m.group(2).upper()
        cmds[c] = cmds.get(c, 0) + 1
    adm = r["ok"]
    return {"path": gp.name, "rate": rate, "secs": secs, "admitted": adm,
            "requests": r["requests"], "commands": total, "in_scripts": lua,
            "per_1000_admitted": total * 1000 / adm if adm else None,
            "by_command": dict(sorted(cmds.items(), key=lambda kv: -kv[1])),
            "p99_ms": r["p99_ms"]}


# ---------------------------------------------------------------------------------------------
# Statistics and report

stats, fmt, ratio = pb.stats, pb.fmt, pb.ratio


def summarize(runs: dict, order: list[str]) -> dict:
    """runs[path][kind] = per-repetition dicts; kind is a rate or 'slow'."""
    S: dict = {}
    for p in order:
        S[p] = {}
        for kind, reps in runs[p].items():
            d = {m: stats([r.get(f"{m}_ms") for r in reps]) for m in ("p50", "p90", "p99")}
            d["rps"] = stats([r["rps"] for r in reps])
            for g in ("envoy", "limiter", "redis"):
                d[f"{g}_cpu"] = stats([r.get(f"{g}_cpu_us_per_req") for r in reps])
            d["foreign"] = stats([r["foreign_core_pct"] for r in reps])
            d["bad"] = sum(r["non2xx"] + r["errors"] for r in reps)
            if p != "baseline" and "baseline" in runs and kind in runs["baseline"]:
                base = runs["baseline"][kind]
                d["add_p50"] = stats([r["p50_ms"] - b["p50_ms"] for r, b in zip(reps, base)])
                d["add_p99"] = stats([r["p99_ms"] - b["p99_ms"] for r, b in zip(reps, base)])
                d["p99_over_base"] = stats([r["p99_ms"] / b["p99_ms"] for r, b in zip(reps, base)
                                            if b["p99_ms"] > 0])
            S[p][kind] = d
    return S


def med(S: dict, p: str, kind: str, metric: str) -> float | None:
    try:
        return S[p][kind][metric]["med"]
    except (KeyError, TypeError):
        return None


def goals(S: dict, counts: dict, slow: dict) -> list[dict]:
    G: list[dict] = []

    def add(what, target, ours, peer, bound, unit, note=""):
        r = ratio(ours, peer)
        verdict = "n/a" if r is None else ("PASS" if r <= bound else "MISS")
        if unit == "" and ours == 0:
            # No Redis command at all means the service did not use Redis, not a win.
            verdict, note = "n/a", (note + "; " if note else "") + "no Redis command seen"
        G.append({"what": what, "target": target, "ours": ours, "peer": peer, "ratio": r,
                  "bound": bound, "verdict": verdict, "unit": unit, "note": note})

    for rate in RATES:
        k = str(rate)
        add(f"tollgate RLS added p99 @ {rate} rps vs envoyproxy/ratelimit", "≤ 0.5×",
            med(S, "tollgate-rls", k, "add_p99"), med(S, "ratelimit", k, "add_p99"), 0.5, "ms")
    c_tg = (counts.get("tollgate-rls") or {}).get("per_1000_admitted")
    c_rl = (counts.get("ratelimit") or {}).get("per_1000_admitted")
    add(f"Redis commands per 1000 admitted @ {COUNT_RATE} rps, tollgate RLS vs "
        "envoyproxy/ratelimit", "≤ 0.02× (1/50)", c_tg, c_rl, 0.02, "")
    c_q = (counts.get("tollgate-rlqs") or {}).get("per_1000_admitted")
    if c_q is not None:
        add(f"Redis commands per 1000 admitted @ {COUNT_RATE} rps, tollgate RLQS vs "
            "envoyproxy/ratelimit", "≤ 0.02× (1/50)", c_q, c_rl, 0.02, "", "extra")
    for rate in RATES:
        k = str(rate)
        paired = med(S, "tollgate-rlqs", k, "p99_over_base")
        add(f"tollgate RLQS p99 @ {rate} rps vs Envoy without a limiter", "≤ 1.05×",
            med(S, "tollgate-rlqs", k, "p99"), med(S, "baseline", k, "p99"), 1.05, "ms",
            f"median of per-repetition ratios {paired:.3f}" if paired is not None else "")
    for p in ("tollgate-rls", "tollgate-rlqs", "ratelimit"):
        if p in slow:
            add(f"{SHORT[p]} hot-key p99 @ {SLOW_RATE} rps, Redis +{SLOW_MS} ms vs normal Redis",
                "≤ 1.1×", slow[p]["slow_p99"], slow[p]["normal_p99"], 1.1, "ms",
                "the peer, for contrast" if p == "ratelimit" else "")
    return G


def f3(v: float | None, d: int = 3) -> str:
    return "–" if v is None else f"{v:.{d}f}"


def report(S: dict, order: list[str], counts: dict, acc: dict, slow: dict, SS: dict,
           G: list[dict], meta: dict, envoy_stats: dict) -> str:
    L: list[str] = []
    L.append(f"# tollgate gateway benchmark — {meta['date']}{' (QUICK)' if QUICK else ''}")
    L.append("")
    L.append(f"Command: `{meta['command']}` · paths {', '.join(order)} · {REPS} interleaved "
             f"repetitions · vegeta open loop `-rate R -duration {LOAD_SECS}s -workers {CONNS} "
             f"-max-connections {MAX_CONNS}`, {KEYS} key(s) · Envoy, limit services and Redis on CPU {SUT_CPU}, "
             f"vegeta, app and relays on CPU {GEN_CPU}{pb.sched_text()} · Envoy ratelimit "
             f"filter timeout {TIMEOUT_MS} ms, failure_mode_deny false.")
    L.append("")
    L.append("Values are `median (min–max)` over repetitions. *Added* latency is the "
             "per-repetition difference to the baseline (Envoy, no limiter) run of the same "
             "repetition. CPU is utime+stime from `/proc/PID/stat` per completed request.")
    L.append("")
    if S:
        L.append(f"## Latency and CPU, limit {LIMIT:,}/s (never binds)")
        L.append("")
        L.append("| path | rate | p50 ms | p99 ms | added p50 | added p99 | achieved rps | "
                 "non-2xx/errors | limit service µs/req | its Redis µs/req | Envoy µs/req |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for rate in RATES:
            for p in order:
                d = S[p][str(rate)]
                L.append(f"| {SHORT[p]} | {rate} | {fmt(d['p50'])} | {fmt(d['p99'])} | "
                         f"{fmt(d.get('add_p50')) if p != 'baseline' else '–'} | "
                         f"{fmt(d.get('add_p99')) if p != 'baseline' else '–'} | "
                         f"{fmt(d['rps'], 0)} | {d['bad']} | {fmt(d['limiter_cpu'], 1)} | "
                         f"{fmt(d['redis_cpu'], 1)} | {fmt(d['envoy_cpu'], 1)} |")
        L.append("")
    if counts:
        L.append(f"## Redis commands (client-issued, `redis-cli MONITOR`), {COUNT_RATE} rps for "
                 f"{COUNT_SECS} s")
        L.append("")
        L.append("| path | admitted | commands | per 1000 admitted | by command | "
                 "commands run inside scripts (not counted) |")
        L.append("|---|---|---|---|---|---|")
        for p in order:
            c = counts.get(p)
            if not c:
                continue
            by = ", ".join(f"{k} {v}" for k, v in list(c["by_command"].items())[:6])
            L.append(f"| {SHORT[p]} | {c['admitted']:,} | {c['commands']:,} | "
                     f"{f3(c['per_1000_admitted'], 1)} | {by or '–'} | {c['in_scripts']:,} |")
        L.append("")
    if acc:
        L.append(f"## Accuracy: limit {ACC_LIMIT:,}/s, {ACC_RATE:,} req/s offered for "
                 f"{ACC_SECS} s on one key")
        L.append("")
        L.append("| path | requests sent / offered | admitted (200) | rejected (429) | "
                 "other/errors | limit × seconds | admitted / (limit × seconds) |")
        L.append("|---|---|---|---|---|---|---|")
        for p in order:
            a = acc.get(p)
            if not a:
                continue
            L.append(f"| {SHORT[p]} | {a['requests']:,} / {a.get('offered', 0):,} | {a['ok']:,} | "
                     f"{a['rejected']:,} | "
                     f"{a['non2xx'] - a['rejected'] + a['errors']:,} | {a['allowed']:,} | "
                     f"{f3(a['ratio'])} |")
        L.append("")
        L.append("A run of S seconds touches S or S+1 one-second windows, and a token bucket "
                 "starts full, so up to (S+1) × limit can be right.")
        wu = (acc.get("tollgate-rlqs") or {}).get("warmup")
        if wu:
            L.append("")
            L.append(f"RLQS: the measured key was first loaded at {ACC_RATE:,} req/s for "
                     f"{wu['secs']} s (Envoy 1.40 reports every 5 s and allows all until the "
                     f"first assignment): {wu['ok']:,} admitted, {wu['rejected']:,} refused of "
                     f"{wu['requests']:,}; the measured run followed on the same bucket.")
        L.append("")
    if slow:
        L.append(f"## Redis slowed by {SLOW_MS} ms per round trip (userspace relay), hot key, "
                 f"{SLOW_RATE} rps")
        L.append("")
        L.append("| path | p50 ms | p99 ms | added p99 | p99 with normal Redis | slow / normal "
                 "p99 | non-2xx/errors | Envoy limiter counters (whole phase) |")
        L.append("|---|---|---|---|---|---|---|---|")
        for p in order:
            if p not in SS:
                continue
            d = SS[p]["slow"]
            s = slow.get(p, {})
            es = ", ".join(f"{k.split('.', 2)[-1] if k.count('.') > 1 else k} {v}"
                           for k, v in (envoy_stats.get(p) or {}).items()) or "–"
            L.append(f"| {SHORT[p]} | {fmt(d['p50'])} | {fmt(d['p99'])} | "
                     f"{fmt(d.get('add_p99')) if p != 'baseline' else '–'} | "
                     f"{f3(s.get('normal_p99'))} | {f3(s.get('ratio'), 2)} | {d['bad']} | "
                     f"{es} |")
        L.append("")
    L.append("## Goals")
    L.append("")
    L.append("| goal | target | ours | peer | ratio | verdict |")
    L.append("|---|---|---|---|---|---|")
    for g in G:
        L.append(f"| {g['what']}{' (' + g['note'] + ')' if g['note'] else ''} | {g['target']} | "
                 f"{f3(g['ours'])} | {f3(g['peer'])} | {f3(g['ratio'], 3)} | "
                 f"**{g['verdict']}** |")
    L.append("")
    L.append("## Environment")
    L.append("")
    for k in ("host", "envoy", "ratelimit", "sidecar", "vegeta", "redis", "nginx",
              "load_before", "load_after", "duration"):
        if k in meta:
            L.append(f"- {k}: {meta[k]}")
    if meta.get("foreign_before"):
        L.append(f"- busiest other processes before: {'; '.join(meta['foreign_before'])}")
    if S:
        fg = [S[p][k]["foreign"]["med"] for p in order for k in S[p] if S[p][k]["foreign"]]
        if fg:
            L.append(f"- foreign share of CPU {SUT_CPU} during runs (median per run): "
                     f"{min(fg):.0f}–{max(fg):.0f} %")
    L.append("")
    return "\n".join(L)


def svg_plot(S: dict, SS: dict, order: list[str], out: Path, title: str) -> None:
    """Grouped bars on a log axis: p50 and p99 per path, one panel per rate and one for slow
    Redis; whiskers min–max."""
    panels = [(str(r), f"{r} rps", S) for r in RATES if S] + \
             ([("slow", f"{SLOW_RATE} rps, Redis +{SLOW_MS} ms", SS)] if SS else [])
    if not panels:
        return
    left, right, top = 60, 20, 60
    panel_w = max(240, 110 * len(order))
    W = left + right + panel_w * len(panels)
    legend_rows = (len(order) + 1) // 2
    H = 370 + 20 * legend_rows
    bottom = H - 70 - 20 * legend_rows
    vals = [s[k] for _, _, src in panels for p in order for k in ("min", "max")
            for kind in [_[0] for _ in panels]
            for s in [((src.get(p) or {}).get(kind) or {}).get("p99"),
                      ((src.get(p) or {}).get(kind) or {}).get("p50")] if s and s[k] > 0]
    vmin = 10 ** math.floor(math.log10(min(vals))) if vals else 0.1
    vmax = 10 ** math.ceil(math.log10(max(vals))) if vals else 10

    def y(v: float) -> float:
        v = max(v, vmin)
        return bottom - (math.log10(v) - math.log10(vmin)) / \
            (math.log10(vmax) - math.log10(vmin)) * (bottom - top)

    e = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W:.0f}" height="{H}" '
         f'font-family="sans-serif" font-size="12">',
         f'<rect width="{W:.0f}" height="{H}" fill="white"/>',
         f'<text x="{W / 2:.0f}" y="22" text-anchor="middle" font-size="15">{title}</text>',
         f'<text x="{W / 2:.0f}" y="40" text-anchor="middle" fill="#555">latency (ms, log '
         f'scale), median of repetitions, whiskers min–max; solid = p50, hatched = p99</text>',
         '<defs><pattern id="hatch" width="5" height="5" patternUnits="userSpaceOnUse" '
         'patternTransform="rotate(45)"><rect width="5" height="5" fill="white"/>'
         '<line x1="0" y1="0" x2="0" y2="5" stroke="black" stroke-width="2" '
         'stroke-opacity="0.35"/></pattern></defs>']
    d = vmin
    while d <= vmax * 1.0001:
        for m in (1, 2, 5):
            v = d * m
            if v > vmax * 1.0001:
                break
            yy = y(v)
            e.append(f'<line x1="{left}" x2="{W - right:.0f}" y1="{yy:.1f}" y2="{yy:.1f}" '
                     f'stroke="{"#ddd" if m == 1 else "#f2f2f2"}"/>')
            e.append(f'<text x="{left - 5}" y="{yy + 4:.1f}" text-anchor="end">{v:g}</text>')
        d *= 10
    for pi, (kind, label, src) in enumerate(panels):
        x0 = left + pi * panel_w
        e.append(f'<text x="{x0 + panel_w / 2:.1f}" y="{bottom + 40}" text-anchor="middle" '
                 f'font-weight="bold">{label}</text>')
        shown = [p for p in order if p in src and kind in src[p]]
        group_w = (panel_w - 30) / max(1, len(shown))
        for gi, p in enumerate(shown):
            gx = x0 + 15 + gi * group_w
            bw = group_w * 0.35
            for mi, m in enumerate(("p50", "p99")):
                s = src[p][kind][m]
                if not s:
                    continue
                bx = gx + group_w * 0.12 + mi * bw
                h = bottom - y(s["med"])
                e.append(f'<rect x="{bx:.1f}" y="{y(s["med"]):.1f}" width="{bw:.1f}" '
                         f'height="{h:.1f}" fill="{COLORS[p]}"/>')
                if m == "p99":
                    e.append(f'<rect x="{bx:.1f}" y="{y(s["med"]):.1f}" width="{bw:.1f}" '
                             f'height="{h:.1f}" fill="url(#hatch)" fill-opacity="0.5"/>')
                cx = bx + bw / 2
                e.append(f'<line x1="{cx:.1f}" x2="{cx:.1f}" y1="{y(s["min"]):.1f}" '
                         f'y2="{y(s["max"]):.1f}" stroke="black"/>')
                for v in (s["min"], s["max"]):
                    e.append(f'<line x1="{cx - 3:.1f}" x2="{cx + 3:.1f}" y1="{y(v):.1f}" '
                             f'y2="{y(v):.1f}" stroke="black"/>')
                e.append(f'<text x="{cx:.1f}" y="{y(s["max"]) - 4:.1f}" text-anchor="middle" '
                         f'font-size="9">{s["med"]:.2f}</text>')
            e.append(f'<text x="{gx + group_w * 0.47:.1f}" y="{bottom + 15}" '
                     f'text-anchor="middle" font-size="10">{AXIS[p]}</text>')
    e.append(f'<line x1="{left}" x2="{W - right:.0f}" y1="{bottom}" y2="{bottom}" '
             f'stroke="black"/>')
    for i, p in enumerate(order):
        lx = left + 10 + (i % 2) * (W - left - right) / 2
        ly = bottom + 58 + 20 * (i // 2)
        e.append(f'<rect x="{lx:.0f}" y="{ly}" width="12" height="12" fill="{COLORS[p]}"/>')
        e.append(f'<text x="{lx + 16:.0f}" y="{ly + 10}" font-size="11">{LABELS[p]}</text>')
    e.append("</svg>")
    out.write_text("\n".join(e) + "\n")


# ---------------------------------------------------------------------------------------------
# Phases


def phase_main(work: Path, app_port: int, redis: dict, keys: list[str]) -> tuple[dict, dict]:
    log(f"phase main: limit {LIMIT:,}/s, {REPS} reps × {RATES} rps × {LOAD_SECS}s")
    st = Stack(work, "main", LIMIT, app_port, redis)
    try:
        for gp in st.paths.values():
            warm(work, gp, keys, 2.0)
        kinds = [str(r) for r in RATES]
        runs = {p: {k: [] for k in kinds} for p in PATHS}
        for rep in range(REPS):
            for kind in kinds:
                for p in PATHS:
                    r = measure(work, st.paths[p], int(kind), LOAD_SECS, keys)
                    runs[p][kind].append(r)
                    lim = (f", limiter {r['limiter_cpu_us_per_req']:.1f} µs/req"
                           if r.get("limiter_cpu_us_per_req") is not None else "")
                    log(f"rep {rep + 1}/{REPS} {kind:>5} {p:<13} p50 {r['p50_ms']:.3f} "
                        f"p99 {r['p99_ms']:.3f} ms, envoy {r['envoy_cpu_us_per_req']:.1f} "
                        f"µs/req{lim}, {r['completed']} done, bad {r['non2xx'] + r['errors']}, "
                        f"foreign {r['foreign_core_pct']:.0f}%, vegeta {r['vegeta_cpu_pct']:.0f}%")
                    time.sleep(0.3)
        counts = {}
        for p in PATHS:
            svc = SERVICE[p]
            if not svc:
                continue
            c = count_redis(work, st.paths[p], redis[svc][1], COUNT_RATE, COUNT_SECS, keys)
            counts[p] = c
            log(f"redis {p:<13} {c['commands']} commands for {c['admitted']} admitted = "
                f"{f3(c['per_1000_admitted'], 1)} per 1000 ({c['by_command']})")
        return runs, counts
    finally:
        st.stop()


def phase_accuracy(work: Path, app_port: int, redis: dict) -> dict:
    log(f"phase accuracy: limit {ACC_LIMIT:,}/s, {ACC_RATE} rps for {ACC_SECS}s")
    st = Stack(work, "acc", ACC_LIMIT, app_port, redis)
    out = {}
    try:
        for p in PATHS:
            if not SERVICE[p]:
                continue
            gp = st.paths[p]
            key = f"acc-{p}-{os.getpid()}"
            warmup = None
            if p == "tollgate-rlqs":
                # The measured bucket itself, at the measured rate, until Envoy holds an
                # assignment for it (see RLQS_WARM_SECS); the measured run follows at once.
                w = attack(work, gp.url, ACC_RATE, RLQS_WARM_SECS, [key])
                warmup = {"secs": RLQS_WARM_SECS, "requests": w["requests"], "ok": w["ok"],
                          "rejected": w["rejected"], "errors": w["errors"]}
                log(f"accuracy {p:<13} warm-up {RLQS_WARM_SECS}s on the measured key: "
                    f"{w['ok']} admitted, {w['rejected']} refused of {w['requests']}")
                if not w["rejected"]:
                    log("warning: no request refused during the RLQS warm-up (no assignment "
                        "reached Envoy yet?)")
            else:
                warm(work, gp, [f"warm-{p}"], 1.0)
                time.sleep(1.1)
            r = attack(work, gp.url, ACC_RATE, ACC_SECS, [key])
            if warmup is not None:
                r["warmup"] = warmup
            allowed = ACC_LIMIT * ACC_SECS
            r["allowed"] = allowed
            r["offered"] = ACC_RATE * ACC_SECS
            if r["requests"] < 0.95 * r["offered"]:
                log(f"warning: vegeta sent {r['requests']} of {r['offered']} requests "
                    "(the load generator fell behind; the run does not test the limit)")
            r["ratio"] = r["ok"] / allowed
            out[p] = r
            log(f"accuracy {p:<13} admitted {r['ok']} of {r['requests']} (limit × secs "
                f"{allowed}): {r['ratio']:.3f}; 429 {r['rejected']}, errors {r['errors']}")
        return out
    finally:
        st.stop()


def phase_slow(work: Path, app_port: int, redis: dict) -> tuple[dict, dict]:
    log(f"phase slow: Redis +{SLOW_MS} ms per round trip, {SLOW_REPS} reps × {SLOW_RATE} rps")
    relays = {}
    relay_procs = []
    for svc in sorted({SERVICE[p] for p in PATHS if SERVICE[p]}):
        (port,) = pb.free_ports(1)
        rp = pb.spawn(f"relay-{svc}", [sys.executable, str(Path(__file__).resolve()), "relay",
                                       str(port), str(redis[svc][1]), str(SLOW_MS)],
                      GEN_CPU, work / f"relay-{svc}.log")
        wait_tcp(port, rp, f"relay for {svc}")
        relays[svc] = port
        relay_procs.append(rp)
    st = None
    try:
        st = Stack(work, "slow", LIMIT, app_port, redis, relays)
        hot = ["hot"]
        runs = {p: {"slow": []} for p in PATHS}
        for rep in range(SLOW_REPS):
            for p in PATHS:
                # A hot key has recurring traffic: warm it right before each run. The paths
                # take turns, so without this a key sat idle ~25 s between its runs, longer
                # than a lease lives (1 s), and each run measured a cold key's first lease
                # through the slow Redis instead.
                attack(work, st.paths[p].url, SLOW_RATE, 2.0, hot)
                r = measure(work, st.paths[p], SLOW_RATE, LOAD_SECS, hot)
                runs[p]["slow"].append(r)
                log(f"slow rep {rep + 1}/{SLOW_REPS} {p:<13} p50 {r['p50_ms']:.3f} "
                    f"p99 {r['p99_ms']:.3f} ms, bad {r['non2xx'] + r['errors']}")
                time.sleep(0.3)
        es = {p: envoy_limiter_stats(st.paths[p]) for p in PATHS}
        return runs, es
    finally:
        if st:
            st.stop()
        stop_procs(relay_procs)


def write_configs(out: Path) -> int:
    """Writes every Envoy config and policy the benchmark uses and validates the Envoy ones."""
    out.mkdir(parents=True, exist_ok=True)
    for p in ALL_PATHS:
        conf = out / f"envoy-{p}.yaml"
        conf.write_text(envoy_config(ENVOY_KIND[p], 10000, 10001, 10002,
                                     None if p == "baseline" else 10003))
        validate_envoy(conf)
        print(f"{conf}: envoy --mode validate OK")
    (out / "ratelimit-bench.yaml").write_text(ratelimit_config(LIMIT))
    (out / "policy.yaml").write_text(tollgate_policy(LIMIT))
    print(f"{out / 'ratelimit-bench.yaml'}, {out / 'policy.yaml'}")
    return 0


def main() -> int:
    signal.signal(signal.SIGTERM, pb.on_signal)
    signal.signal(signal.SIGHUP, pb.on_signal)
    bad = [p for p in PATHS if p not in ALL_PATHS]
    if bad:
        raise SystemExit(f"unknown path(s) {bad}; known: {ALL_PATHS}")
    t_start = time.time()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tollgate-gateway-"))
    uses_tg = any(SERVICE[p] == "tollgate" for p in PATHS)
    meta = {
        "date": dt.datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
        "command": os.environ.get("BENCH_COMMAND", "bench/gateway.sh"),
        "host": f"{platform.node()} · {platform.platform()} · {os.cpu_count()} CPUs · "
                f"{pb.cpu_model()}",
        "envoy": pb.tool_version([ENVOY, "--version"]).replace(ENVOY, "envoy"),
        "ratelimit": os.environ.get("RATELIMIT_SOURCE", RATELIMIT_BIN),
        "sidecar": (f"{os.environ.get('SIDECAR_SOURCE', SIDECAR_BIN)} @ {pb.git_rev()}"
                    if uses_tg else "not run"),
        "vegeta": pb.tool_version([VEGETA, "-version"]),
        "redis": pb.tool_version([REDIS_SERVER, "--version"]),
        "nginx": pb.tool_version([NGINX, "-v"]),
        "load_before": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
        "foreign_before": pb.busiest_foreign(),
    }
    log(f"work dir {work}; paths {PATHS}, phases {PHASES}")
    keys = [f"k{i}" for i in range(KEYS)] if KEYS > 1 else ["bench"]
    try:
        if uses_tg:
            pol = work / "policy-check.yaml"
            pol.write_text(tollgate_policy(LIMIT))
            r = subprocess.run([SIDECAR_BIN, "check", str(pol)], capture_output=True, text=True,
                               timeout=30)
            if r.returncode != 0:
                raise RuntimeError(f"tollgate-sidecar check failed:\n{r.stdout}{r.stderr}")
        (app_port,) = pb.free_ports(1)
        app = pb.start_nginx("app", pb.write_app_conf(work, app_port), work, GEN_CPU)
        pb.wait_http(f"http://127.0.0.1:{app_port}/", app, "app nginx")
        redis: dict[str, tuple[int, int]] = {}
        for svc in sorted({SERVICE[p] for p in PATHS if SERVICE[p]}):
            rp, port = start_redis(work, f"redis-{svc}")
            redis[svc] = (rp.pid, port)
        runs, counts, acc, sruns, envoy_stats = {}, {}, {}, {}, {}
        if "main" in PHASES:
            runs, counts = phase_main(work, app_port, redis, keys)
        if "accuracy" in PHASES:
            for _, port in redis.values():
                redis_cmd(port, "flushall")
            acc = phase_accuracy(work, app_port, redis)
        if "slow" in PHASES:
            for _, port in redis.values():
                redis_cmd(port, "flushall")
            sruns, envoy_stats = phase_slow(work, app_port, redis)
        meta["load_after"] = " ".join(Path("/proc/loadavg").read_text().split()[:3])
        meta["duration"] = f"{time.time() - t_start:.0f} s"
        S = summarize(runs, PATHS) if runs else {}
        SS = summarize(sruns, PATHS) if sruns else {}
        slow = {}
        for p in PATHS:
            if SS and S and str(SLOW_RATE) in S[p]:
                n99, s99 = med(S, p, str(SLOW_RATE), "p99"), med(SS, p, "slow", "p99")
                slow[p] = {"normal_p99": n99, "slow_p99": s99, "ratio": ratio(s99, n99)}
            elif SS:
                slow[p] = {"normal_p99": None, "slow_p99": med(SS, p, "slow", "p99"),
                           "ratio": None}
        G = goals(S, counts, slow)
        md = report(S, PATHS, counts, acc, slow, SS, G, meta, envoy_stats)
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        suffix = "-quick" if QUICK else ""
        md_path = OUT_DIR / f"gateway-{stamp}{suffix}.md"
        md_path.write_text(md)
        (OUT_DIR / f"gateway-{stamp}{suffix}.json").write_text(json.dumps(
            {"meta": meta,
             "config": {"paths": PATHS, "phases": PHASES, "reps": REPS, "load_secs": LOAD_SECS,
                        "rates": RATES, "conns": CONNS, "max_conns": MAX_CONNS, "keys": KEYS, "limit": LIMIT,
                        "acc_limit": ACC_LIMIT, "acc_rate": ACC_RATE, "acc_secs": ACC_SECS,
                        "rlqs_warm_secs": RLQS_WARM_SECS,
                        "count_rate": COUNT_RATE, "count_secs": COUNT_SECS,
                        "slow_ms": SLOW_MS, "slow_rate": SLOW_RATE, "timeout_ms": TIMEOUT_MS,
                        "sched": pb.SCHED, "quick": QUICK},
             "runs": runs, "summary": S, "redis_commands": counts, "accuracy": acc,
             "slow_runs": sruns, "slow_summary": SS, "slow": slow,
             "envoy_limiter_stats_slow": envoy_stats, "goals": G}, indent=1))
        svg = OUT_DIR / "gateway-latency.svg"
        svg_plot(S, SS, PATHS, svg, f"Envoy rate limit services, open loop — {meta['date']}"
                 f"{' (QUICK)' if QUICK else ''}")
        print(md)
        log(f"wrote {md_path}, {svg}")
        return 0
    finally:
        pb.cleanup()
        for f in sorted(work.rglob("*"), reverse=True):
            try:
                f.unlink() if f.is_file() else f.rmdir()
            except OSError:
                pass
        try:
            work.rmdir()
        except OSError:
            pass


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "relay":
        sys.exit(relay_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "configs":
        sys.exit(write_configs(Path(sys.argv[2])))
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        pb.cleanup()
        sys.exit(130)
