#!/usr/bin/env python3
"""Where does tollgate-sidecar spend its CPU per proxied request? (see bench/README.md)

    python3 bench/profile_sidecar.py [perf|strace] [--peer]

Starts the app (nginx return 200) on CPU 0 and the sidecar (same policy as bench/proxy.sh)
on CPU 1, both SCHED_FIFO like the benchmark, then
  perf:   `perf record -e cpu-clock` during a wrk -t1 -c32 saturation run; prints self time
          grouped by crate (kernel, tokio, hyper, http, libc malloc/memcpy, ...) and the top
          user-space symbols;
  strace: `strace -c -f` during a 5k rps oha run; prints syscalls per request.
--peer profiles nginx proxy_pass + limit_req the same way, for comparison. perf mode also
lists the top kernel symbols (most of a proxy's CPU is in the kernel).

Uses SIDECAR_BIN (default target/release/tollgate-sidecar) and OHA as bench/proxy.sh does.
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proxy_bench as b  # noqa: E402


def group(report: str, top: int) -> None:
    agg: collections.Counter = collections.Counter()
    syms = []
    ksyms = []
    for line in report.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[(.)\]\s+(.*)", line)
        if not m:
            continue
        pct, dso, kind, sym = float(m.group(1)), m.group(2), m.group(3), m.group(4).strip()
        if kind == "k":
            key = "kernel"
            ksyms.append((pct, sym))
        elif "libc" in dso:
            if re.search(r"malloc|free|_int_|consolidate|tcache|realloc|unlink_chunk", sym):
                key = "libc malloc/free"
            elif "mem" in sym:
                key = "libc memmove/memcpy"
            else:
                key = "libc other"
        else:
            key = sym.lstrip("<").split("::")[0] or sym[:30]
            syms.append((pct, sym))
        agg[key] += pct
    print("self time by crate / area:")
    for k, v in agg.most_common(top):
        print(f"  {v:6.2f}%  {k}")
    print("top user-space symbols:")
    for pct, sym in sorted(syms, reverse=True)[:top]:
        print(f"  {pct:6.2f}%  {sym[:150]}")
    # Kernel time is most of a proxy's CPU; comparing these with --peer shows whether the
    # difference is in the syscalls themselves or in what triggers them.
    print("top kernel symbols:")
    for pct, sym in sorted(ksyms, reverse=True)[:top]:
        print(f"  {pct:6.2f}%  {sym[:150]}")


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else "perf"
    names = ["tollgate"] + (["nginx"] if "--peer" in sys.argv else [])
    b.PATHS = ["direct"] + names
    work = Path(tempfile.mkdtemp(prefix="tollgate-profile-"))
    out = Path(tempfile.mkdtemp(prefix="tollgate-profile-out-"))
    try:
        paths, _app, _port = b.setup(work)
        for name in names:
            pth = paths[name]
            b.warm(pth)
            target = pth.pids()[-1]  # the sidecar itself, or the nginx worker
            if mode == "perf":
                data = out / f"{name}.data"
                rec = subprocess.Popen(["perf", "record", "-e", "cpu-clock", "-F", "4000", "-o",
                                        str(data), "-p", str(target)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            else:
                data = out / f"{name}.strace"
                rec = subprocess.Popen(["strace", "-c", "-f", "-o", str(data), "-p", str(target)],
                                       stderr=subprocess.DEVNULL)
            b.STARTED.append((Path(rec.args[0]).name, rec))
            time.sleep(1)
            r = b.measure(pth, "sat" if mode == "perf" else "5000")
            rec.send_signal(2)
            rec.wait()
            print(f"=== {b.LABELS[name]}: {r['completed']} requests, "
                  f"{r['cpu_us_per_req']:.1f} CPU µs/req (under the profiler)")
            if mode == "perf":
                rep = subprocess.run(["perf", "report", "-i", str(data), "--no-children",
                                      "--sort", "dso,sym", "--stdio"],
                                     capture_output=True, text=True).stdout
                group(rep, 25)
            else:
                print("syscalls per request:")
                for line in data.read_text().splitlines():
                    f = line.split()
                    if len(f) >= 5 and f[3].isdigit() and f[-1] != "total":
                        print(f"  {int(f[3]) / r['completed']:7.3f}  {f[-1]}")
    finally:
        b.cleanup()
        subprocess.run(["rm", "-rf", str(work), str(out)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
