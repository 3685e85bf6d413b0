#!/usr/bin/env python3
"""A/B of sidecar builds or settings by CPU time, interleaved (see bench/README.md).

    python3 bench/ab_sidecar.py NAME=BINARY[,VAR=VALUE...] NAME=BINARY[,VAR=VALUE...] ...

Each variant is a sidecar binary plus optional environment variables, started with the same
policy and setup as bench/proxy.sh (app on GEN_CPU, sidecars on SUT_CPU, SCHED_FIFO). The
variants are measured in turn (A B A B ...) REPS times, at saturation (wrk) and at the highest
of RATES (oha), so drift in machine load hits them alike; medians of CPU µs per request and of
saturation req/s are printed. For deciding whether a change that instruction counts cannot see
(syscalls, wake-ups, runtime settings) is worth keeping. Knobs as in proxy.sh: REPS (default
5 here), SAT_SECS, LOAD_SECS, RATES, SUT_CPU, GEN_CPU, SCHED.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("REPS", "5")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import proxy_bench as b  # noqa: E402


def start(name: str, binary: str, env: dict[str, str], work: Path, app_port: int) -> b.Path_:
    port, admin = b.free_ports(2)
    pol = work / "policy-per-ip.yaml"
    pol.write_text(b.POLICY_PER_IP)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        p = b.spawn(f"tollgate-{name}", [binary, "--listen", f"127.0.0.1:{port}",
                                         "--upstream", f"http://127.0.0.1:{app_port}",
                                         "--policies", str(pol), "--admin", f"127.0.0.1:{admin}",
                                         "--log", "warn"], b.SUT_CPU, work / f"{name}.log")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    b.wait_http(f"http://127.0.0.1:{admin}/readyz", p, name)
    b.wait_http(f"http://127.0.0.1:{port}/", p, f"{name} proxy")
    return b.Path_(name, f"http://127.0.0.1:{port}/", [p])


def main() -> int:
    variants = []
    for arg in sys.argv[1:]:
        name, _, rest = arg.partition("=")
        binary, *pairs = rest.split(",")
        variants.append((name, binary, dict(p.split("=", 1) for p in pairs)))
    if len(variants) < 2:
        print(__doc__)
        return 2
    work = Path(tempfile.mkdtemp(prefix="tollgate-ab-"))
    rate = str(max(b.RATES))
    res: dict[str, dict[str, list[float]]] = {n: {"sat": [], "rps": [], rate: []}
                                             for n, _, _ in variants}
    try:
        b.PATHS = ["direct"]
        _paths, _app, app_port = b.setup(work)
        paths = {n: start(n, binary, env, work, app_port) for n, binary, env in variants}
        for p in paths.values():
            b.warm(p)
        for rep in range(b.REPS):
            for kind in ("sat", rate):
                for n, p in paths.items():
                    r = b.measure(p, kind)
                    res[n][kind].append(r["cpu_us_per_req"])
                    if kind == "sat":
                        res[n]["rps"].append(r["rps"])
                    b.log(f"rep {rep + 1} {kind:>5} {n:<12} {r['cpu_us_per_req']:.2f} µs/req "
                          f"{r['rps']:.0f} req/s, foreign core {r['foreign_core_pct']:.0f}%")
    finally:
        b.cleanup()
    print(f"| variant | CPU µs/req @ sat | CPU µs/req @ {rate} | saturation req/s |")
    print("|---|---|---|---|")
    for n, r in res.items():
        print(f"| {n} | {statistics.median(r['sat']):.2f} | {statistics.median(r[rate]):.2f} "
              f"| {statistics.median(r['rps']):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
