#!/usr/bin/env python3
"""CPU the sidecar spends per admitted vs per rejected request (see bench/README.md).

    python3 bench/cpu_per_decision.py            # both measurements, ~3 minutes
    MODE=ir python3 bench/cpu_per_decision.py    # instruction counts only
    MODE=time python3 bench/cpu_per_decision.py  # CPU time only

Cases (same header-keyed token bucket rule, one client key, one keep-alive connection):
  admitted          1e9 per second: every request is decided and forwarded to the app
  rejected          1 per hour: every request after the first is answered 429 by the sidecar;
                    audit lines suppressed (--audit-per-second 0), which is what a flood sees
                    once the default 100 lines/s are used up
  rejected+logged   as rejected, but every rejection writes its audit line (worst case)

1. Instructions (valgrind cachegrind, --cache-sim=no): user-space instructions executed by the
   sidecar, as (Ir(N2 requests) - Ir(N1 requests)) / (N2 - N1) from two runs, so start-up and
   shutdown cancel out. Independent of CPU speed and other load (only how often the event loop
   goes idle between requests varies with timing: up to ~15 % between repetitions); the figure
   to trust on a busy machine. Kernel work (syscalls) is not counted.
2. CPU time: utime+stime of the sidecar (/proc/<pid>/stat, kernel included) per request at a
   fixed open-loop rate (oha -q RATE), the cases interleaved REPS times. Noisy on a shared VM.

The sidecar is the release build (SIDECAR_BIN, default target/release/tollgate-sidecar, built
unless SKIP_BUILD=1) with one worker; the app is nginx `return 200`. Writes
bench/results/cpu-per-decision-<date>.md and .json. Every process started is stopped by PID.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from proxy_bench import http_get, wait_http  # noqa: E402 (bench/ is the script's directory)

ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")


def env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    return int(v) if v else default


MODE = os.environ.get("MODE", "both")
N1 = env_int("N1", 1000)
N2 = env_int("N2", 6000)
IR_REPS = env_int("IR_REPS", 3)
RATE = env_int("RATE", 5000)
SECS = env_int("SECS", 5)
REPS = env_int("REPS", 3)
CONNS = env_int("CONNS", 16)
SCHED = os.environ.get("SCHED", "fifo")
SUT_CPU = os.environ.get("SUT_CPU", "1")
GEN_CPU = os.environ.get("GEN_CPU", "0")
OUT_DIR = Path(os.environ.get("OUT_DIR", str(ROOT / "bench/results")))
_OHA_CACHED = ROOT / ".cache/tools/bin/oha"
OHA = os.environ.get("OHA", str(_OHA_CACHED) if _OHA_CACHED.exists() else "oha")
NGINX = os.environ.get("NGINX", "nginx")
VALGRIND = os.environ.get("VALGRIND", "valgrind")

CASES = {
    # name: (requests per period, period, extra sidecar args)
    "admitted": (1_000_000_000, "1s", ["--audit-per-second", "0"]),
    "rejected": (1, "1h", ["--audit-per-second", "0"]),
    "rejected+logged": (1, "1h", ["--audit-per-second", "1000000000"]),
}

STARTED: list[subprocess.Popen] = []


def log(msg: str) -> None:
    print(f"[cpu {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def policy(requests: int, period: str) -> str:
    return f"""apiVersion: tollgate.dev/v1alpha1
kind: RateLimitPolicy
metadata:
  name: bench
  namespace: default
spec:
  targetRef:
    selector: {{}}
  rules:
    - name: per-key
      key:
        - header: x-api-key
      limit:
        requests: {requests}
        period: {period}
      scope: Local
"""


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


def prefix(cpu: str | None) -> list[str]:
    """taskset (and chrt for SCHED=fifo) for timed processes; nothing for cpu=None."""
    if cpu is None:
        return []
    p = ["taskset", "-c", cpu]
    if SCHED == "fifo":
        p = ["chrt", "-f", "1"] + p
    return p


def spawn(argv: list[str], logfile: Path, cpu: str | None = None) -> subprocess.Popen:
    """Starts a process; cpu=None: unpinned at normal priority (valgrind runs, where only
    instruction counts matter and real-time priority would just starve the machine)."""
    out = open(logfile, "ab")
    p = subprocess.Popen(prefix(cpu) + argv, stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                         start_new_session=True)
    STARTED.append(p)
    return p


def stop(p: subprocess.Popen, timeout: float = 60) -> None:
    if p.poll() is None:
        try:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)
    if p in STARTED:
        STARTED.remove(p)


def cleanup() -> None:
    for p in reversed(list(STARTED)):
        stop(p, timeout=5)


def metric(admin: str, name: str, labels: dict[str, str]) -> float:
    _, text = http_get(f"{admin}/metrics", timeout=5)
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, value = line.rsplit(" ", 1)
        if series.split("{")[0] != name:
            continue
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total


def start_app(work: Path) -> tuple[subprocess.Popen, int]:
    (port,) = free_ports(1)
    tmp = work / "app-tmp"
    tmp.mkdir(exist_ok=True)
    conf = work / "app.conf"
    conf.write_text(f"""
worker_processes 1;
pid {work}/app.pid;
error_log {work}/app-error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/body; proxy_temp_path {tmp}/proxy; fastcgi_temp_path {tmp}/fcgi;
  uwsgi_temp_path {tmp}/uwsgi; scgi_temp_path {tmp}/scgi;
  keepalive_requests 100000000;
  server {{ listen 127.0.0.1:{port}; location / {{ return 200 "ok\\n"; }} }}
}}
""")
    p = spawn([NGINX, "-p", str(work), "-e", str(work / "app-error.log"), "-c", str(conf),
               "-g", "daemon off;"], work / "app.log", GEN_CPU)
    wait_http(f"http://127.0.0.1:{port}/", p, "app nginx", secs=10)
    return p, port


def sidecar_argv(bin_: str, work: Path, case: str, app_port: int) -> tuple[list[str], int, int]:
    requests, period, extra = CASES[case]
    pol = work / f"policy-{case}.yaml"
    pol.write_text(policy(requests, period))
    port, admin = free_ports(2)
    argv = [bin_, "--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{admin}",
            "--upstream", f"http://127.0.0.1:{app_port}", "--policies", str(pol),
            "--workers", "1", "--reload-interval", "1h", *extra]
    return argv, port, admin


def drive(port: int, n: int) -> dict[int, int]:
    """n sequential requests over one keep-alive connection; status counts."""
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    req = b"GET / HTTP/1.1\r\nHost: bench\r\nx-api-key: bench-client\r\n\r\n"
    buf = b""
    counts: dict[int, int] = {}
    for _ in range(n):
        s.sendall(req)
        while True:
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                head = buf[:end].decode("latin-1")
                m = re.search(r"(?im)^content-length:\s*(\d+)", head)
                total = end + 4 + (int(m.group(1)) if m else 0)
                if len(buf) >= total:
                    status = int(head[9:12])
                    counts[status] = counts.get(status, 0) + 1
                    buf = buf[total:]
                    break
            chunk = s.recv(65536)
            if not chunk:
                raise RuntimeError("sidecar closed the connection")
            buf += chunk
    s.close()
    return counts


# ---------------------------------------------------------------------------------------------
# 1. Instruction counts


def wait_started(logfile: Path, proc: subprocess.Popen, what: str, secs: float = 120) -> None:
    """Waits for the sidecar's start-up log line. Not by polling /readyz: every poll would be
    counted, and how many there are depends on how long valgrind takes to start."""
    deadline = time.time() + secs
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} during start-up")
        if logfile.exists() and "tollgate-sidecar started" in logfile.read_text(errors="replace"):
            return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not log its start within {secs} s")


def cachegrind_run(bin_: str, work: Path, case: str, app_port: int, n: int,
                   tag: str) -> tuple[int, dict]:
    argv, port, _admin = sidecar_argv(bin_, work, case, app_port)
    out = work / f"cg-{tag}.out"
    logfile = work / f"cg-{tag}.log"
    p = spawn([VALGRIND, "--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={out}",
               f"--log-file={work}/valgrind-{tag}.log", *argv], logfile)
    wait_started(logfile, p, f"sidecar under valgrind ({tag})")
    counts = drive(port, n)
    stop(p, timeout=120)
    m = re.search(r"^summary:\s+(\d+)", out.read_text(), re.M)
    if not m:
        raise RuntimeError(f"no summary in {out}")
    return int(m.group(1)), counts


def measure_ir(bin_: str, work: Path, app_port: int) -> dict:
    res: dict = {}
    for case in CASES:
        per_req = []
        for rep in range(IR_REPS):
            ir1, c1 = cachegrind_run(bin_, work, case, app_port, N1, f"{case}-{rep}-n1")
            ir2, c2 = cachegrind_run(bin_, work, case, app_port, N2, f"{case}-{rep}-n2")
            want = 200 if case == "admitted" else 429
            if c2.get(want, 0) < N2 - 1:
                raise RuntimeError(f"{case}: unexpected statuses {c2}")
            per_req.append((ir2 - ir1) / (N2 - N1))
            log(f"ir {case} rep {rep + 1}: {per_req[-1]:,.0f} instructions/request "
                f"(Ir {ir1:,} @ {N1}, {ir2:,} @ {N2})")
        res[case] = {"per_request": per_req, "median": statistics.median(per_req)}
    return res


# ---------------------------------------------------------------------------------------------
# 2. CPU time at a fixed rate


def proc_cpu_ticks(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])


def oha(url: str) -> dict:
    argv = prefix(GEN_CPU) + [OHA, "-q", str(RATE), "-z", f"{SECS}s", "-c", str(CONNS), "--no-tui",
                              "--latency-correction", "--output-format", "json",
                              "-H", "x-api-key: bench-client", url]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    STARTED.append(p)
    try:
        out, err = p.communicate(timeout=SECS + 60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        STARTED.remove(p)
    if p.returncode != 0:
        raise RuntimeError(f"oha failed: {err.strip()[-400:]}")
    j = json.loads(out)
    return {str(k): int(v) for k, v in (j.get("statusCodeDistribution") or {}).items()}


def measure_time(bin_: str, work: Path, app_port: int) -> dict:
    procs = {}
    for case in CASES:
        argv, port, admin = sidecar_argv(bin_, work, case, app_port)
        p = spawn(argv, work / f"time-{case}.log", SUT_CPU)
        wait_http(f"http://127.0.0.1:{admin}/readyz", p, f"sidecar ({case})", secs=60)
        procs[case] = (p, port, f"http://127.0.0.1:{admin}")
    res: dict = {case: {"us_per_request": [], "statuses": []} for case in CASES}
    for rep in range(REPS):
        for case, (p, port, admin) in procs.items():
            before_req = sum(metric(admin, "tollgate_requests_total", {"decision": d})
                             for d in ("allowed", "rejected"))
            t0 = proc_cpu_ticks(p.pid)
            codes = oha(f"http://127.0.0.1:{port}/")
            t1 = proc_cpu_ticks(p.pid)
            after_req = sum(metric(admin, "tollgate_requests_total", {"decision": d})
                            for d in ("allowed", "rejected"))
            n = after_req - before_req
            # The metrics scrapes themselves are a handful of requests' worth of CPU; ignored.
            us = (t1 - t0) / CLK_TCK * 1e6 / n if n else float("nan")
            res[case]["us_per_request"].append(us)
            res[case]["statuses"].append(codes)
            log(f"time {case} rep {rep + 1}: {us:.1f} µs/request over {int(n)} requests {codes}")
    for p, _, _ in procs.values():
        stop(p)
    for case in CASES:
        res[case]["median"] = statistics.median(res[case]["us_per_request"])
    return res


# ---------------------------------------------------------------------------------------------


def report(ir: dict | None, tm: dict | None, meta: dict) -> str:
    lines = [f"# CPU per admitted vs rejected request ({meta['date']})", "",
             f"Command: `{meta['command']}`. Sidecar: {meta['sidecar']} (one worker). "
             f"Machine: {meta['cpus']} CPUs, load average {meta['loadavg']} at the start "
             "(shared with other builds).", ""]
    if ir:
        a = ir["admitted"]["median"]
        lines += ["## Instructions per request (valgrind cachegrind, user space only)", "",
                  f"(Ir at {N2} requests − Ir at {N1} requests) / {N2 - N1}, one keep-alive "
                  f"connection, {IR_REPS} repetitions. Instruction counts do not depend on CPU "
                  "speed or on other load; only how often the event loop goes idle between two "
                  "requests does (timing), which moves a case by up to ~15 % between "
                  "repetitions (all shown). Kernel work is not counted.", "",
                  "| case | instructions / request | repetitions | vs admitted |",
                  "|---|---|---|---|"]
        for case, r in ir.items():
            reps = ", ".join(f"{x:,.0f}" for x in r["per_request"])
            lines.append(f"| {case} | {r['median']:,.0f} | {reps} | {r['median'] / a:.2f}× |")
        lines.append("")
    if tm:
        a = tm["admitted"]["median"]
        lines += ["## CPU time per request (utime+stime, kernel included)", "",
                  f"Open loop at {RATE} req/s for {SECS} s ({CONNS} connections, oha), sidecar on "
                  f"CPU {SUT_CPU}, oha and the app on CPU {GEN_CPU}"
                  f"{', SCHED_FIFO' if SCHED == 'fifo' else ''}; cases interleaved, {REPS} "
                  "repetitions. Clock-tick resolution (10 ms) and a busy 2-core VM make these "
                  "±10–20 %; compare the ratios.", "",
                  "| case | µs / request (median) | repetitions | vs admitted |",
                  "|---|---|---|---|"]
        for case, r in tm.items():
            reps = ", ".join(f"{x:.1f}" for x in r["us_per_request"])
            lines.append(f"| {case} | {r['median']:.1f} | {reps} | {r['median'] / a:.2f}× |")
        lines.append("")
    return "\n".join(lines)


def on_sigterm(_signum, _frame):
    raise SystemExit(143)


def main() -> int:
    signal.signal(signal.SIGTERM, on_sigterm)
    bin_src = os.environ.get("SIDECAR_BIN")
    if not bin_src:
        if os.environ.get("SKIP_BUILD", "0") == "0":
            log("cargo build --release -p tollgate-sidecar")
            subprocess.run(["cargo", "build", "--release", "-p", "tollgate-sidecar"], cwd=ROOT,
                           check=True)
        target = Path(os.environ.get("CARGO_TARGET_DIR", str(ROOT / "target")))
        bin_src = str(target / "release/tollgate-sidecar")
    for tool, need in ((VALGRIND, MODE in ("both", "ir")), (OHA, MODE in ("both", "time")),
                       (NGINX, True)):
        if need and not shutil.which(tool):
            log(f"{tool} not found (apt-get install valgrind nginx-light; oha: bench/proxy.sh "
                "installs it into .cache/tools)")
            return 1
    meta = {
        "date": dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "command": "python3 bench/cpu_per_decision.py"
                   + (f" (MODE={MODE})" if MODE != "both" else ""),
        "sidecar": f"{bin_src} (built {time.strftime('%F %T', time.localtime(os.path.getmtime(bin_src)))})",
        "cpus": os.cpu_count(),
        "loadavg": Path("/proc/loadavg").read_text().split()[0],
        "n1": N1, "n2": N2, "rate": RATE, "secs": SECS, "reps": REPS, "sched": SCHED,
    }
    with tempfile.TemporaryDirectory(prefix="tollgate-cpu-") as tmp:
        work = Path(tmp)
        # A private copy: others rebuilding target/ must not swap the binary mid-run.
        bin_ = str(work / "tollgate-sidecar")
        shutil.copy2(bin_src, bin_)
        try:
            app, app_port = start_app(work)
            ir = measure_ir(bin_, work, app_port) if MODE in ("both", "ir") else None
            tm = measure_time(bin_, work, app_port) if MODE in ("both", "time") else None
        finally:
            cleanup()
    text = report(ir, tm, meta)
    print(text)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    (OUT_DIR / f"cpu-per-decision-{stamp}.md").write_text(text + "\n")
    (OUT_DIR / f"cpu-per-decision-{stamp}.json").write_text(
        json.dumps({"meta": meta, "instructions": ir, "cpu_time": tm}, indent=2) + "\n")
    log(f"wrote {OUT_DIR}/cpu-per-decision-{stamp}.md")
    ok = True
    if ir and not ir["rejected"]["median"] < ir["admitted"]["median"]:
        log("FAIL: a rejected request costs at least as many instructions as an admitted one")
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
