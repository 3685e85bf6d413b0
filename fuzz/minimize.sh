#!/usr/bin/env bash
# Minimizes fuzz/corpus/<target> to at most MAX files together with fuzz/seeds/<target>
# (default 200), merging in any extra directories given (e.g. a scratch corpus).
#
#   fuzz/minimize.sh <target> [extra corpus dir...]
#
# libFuzzer's set-cover merge (what `cargo fuzz cmin -- -set_cover_merge=1 -use_counters=0`
# runs) keeps one input per covered edge set but can need several hundred files; this takes the
# same per-input features from its control file and keeps, after the seeds, the inputs that add
# the most uncovered features until MAX. It prints the share of features kept.
set -euo pipefail
cd "$(dirname "$0")/.."
target=$1; shift
max=${MAX:-200}
export PATH="$PWD/.cache/tools/bin:$PATH"

cargo +nightly fuzz build --codegen-units 16 "$target"
bin=fuzz/target/x86_64-unknown-linux-gnu/release/$target
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/merged"
"$bin" -set_cover_merge=1 -use_counters=0 -timeout=10 -rss_limit_mb=3072 \
  -merge_control_file="$work/control" "$work/merged" \
  "fuzz/corpus/$target" "fuzz/seeds/$target" "$@" 2>"$work/merge.log" \
  || { tail -20 "$work/merge.log" >&2; exit 1; }

mkdir "$work/out"
python3 - "$work/control" "fuzz/seeds/$target" "$work/out" "$max" <<'EOF'
import os, shutil, sys
control, seeds, out, cap = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
lines = open(control).read().split("\n")
n = int(lines[0])
files = lines[2 : 2 + n]
features = {}
for line in lines[2 + n :]:
    if line.startswith("FT "):
        parts = line.split()
        features[int(parts[1])] = {int(x) for x in parts[2:]}
seeds = os.path.abspath(seeds)
seed_ids = {i for i, f in enumerate(files) if os.path.dirname(os.path.abspath(f)) == seeds}
covered = set().union(*(features.get(i, set()) for i in seed_ids))
every = set().union(*features.values())
rest = {i: f - covered for i, f in features.items() if i not in seed_ids}
chosen = []
while len(chosen) + len(seed_ids) < cap and rest:
    best = max(rest, key=lambda i: (len(rest[i]), -os.path.getsize(files[i])))
    new = rest.pop(best)
    if not new:
        break
    chosen.append(best)
    covered |= new
    for i in rest:
        rest[i] -= new
names = set()
for i in chosen:
    name = os.path.basename(files[i])
    if name not in names:
        names.add(name)
        shutil.copy(files[i], out)
print(f"{len(files)} inputs, {len(every)} features; {len(seed_ids)} seeds + {len(names)} "
      f"inputs keep {len(covered)} ({100 * len(covered) / max(len(every), 1):.1f}%)")
EOF

rm -rf "fuzz/corpus/$target"
mkdir -p "fuzz/corpus/$target"
cp "$work/out/"* "fuzz/corpus/$target/" 2>/dev/null || true
echo "fuzz/corpus/$target: $(ls "fuzz/corpus/$target" | wc -l) files, $(cat "fuzz/corpus/$target"/* 2>/dev/null | wc -c) bytes"
