#!/usr/bin/env bash
# Build the peers that bench/gateway.sh runs side by side with tollgate, from the Go module
# proxy (no release downloads, no images):
#   ratelimit  envoyproxy/ratelimit's RLS v3 server (github.com/envoyproxy/ratelimit/src/service_cmd)
#   vegeta     the open-loop HTTP load generator (github.com/tsenart/vegeta/v12)
# into <repo>/.cache/peers/ratelimit-<v>-vegeta-<v>/ and print that directory as the last
# line on stdout. Everything else goes to stderr. Binaries already present are reused, so a
# second run is instant.
#
# Each binary comes from a small builder module (<name>/go.mod with a `tool` line, go.sum
# checked in), built in the default -mod=readonly mode so a build never changes the
# dependency graph. GOCACHE and GOMODCACHE are the user's (shared with tools/k8sbin).
#
# Env: PEERS_CACHE (default <repo>/.cache/peers), PEERS_NICE (default 19).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# shellcheck source=versions.env
. "$HERE/versions.env"

log() { printf '[peers] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

command -v go >/dev/null || die "go not found in PATH"
export CGO_ENABLED=0 GOTOOLCHAIN=local
# -buildvcs=false: the builder modules live inside the project's git tree, whose state is
# irrelevant to these binaries.
export GOFLAGS="-buildvcs=false"
NICE=(nice -n "${PEERS_NICE:-19}")

modver() { (cd "$HERE/$1" && go list -m -f '{{.Version}}' "$2"); }
[ "$(modver ratelimit github.com/envoyproxy/ratelimit)" = "$RATELIMIT_VERSION" ] || die "ratelimit/go.mod is not at $RATELIMIT_VERSION"
[ "$(modver vegeta github.com/tsenart/vegeta/v12)" = "$VEGETA_VERSION" ] || die "vegeta/go.mod is not at $VEGETA_VERSION"

CACHE=${PEERS_CACHE:-$ROOT/.cache/peers}
OUT="$CACHE/ratelimit-$RATELIMIT_VERSION-vegeta-$VEGETA_VERSION"
mkdir -p "$OUT"
# Serialise concurrent build.sh runs on the same output directory.
exec 9>"$OUT/.lock"
flock 9

# build <name> <module dir> <package> <ldflags>
build() {
  local name=$1 dir=$2 pkg=$3 ldflags=$4
  if [ -x "$OUT/$name" ]; then log "$name: cached"; return; fi
  log "$name: downloading modules ($dir)"
  local t0=$SECONDS
  (cd "$HERE/$dir" && "${NICE[@]}" go mod download) >&2
  local t1=$SECONDS
  log "$name: building $pkg (nice)"
  (cd "$HERE/$dir" && "${NICE[@]}" go build -trimpath -pgo=off -ldflags "$ldflags" -o "$OUT/$name.tmp" "$pkg") >&2
  mv -f "$OUT/$name.tmp" "$OUT/$name"
  log "$name: done, download $((t1 - t0))s, build $((SECONDS - t1))s, $(stat -c %s "$OUT/$name") bytes"
}

build ratelimit ratelimit github.com/envoyproxy/ratelimit/src/service_cmd "-s -w"
# vegeta -version prints main.Version (its Makefile stamps it the same way).
build vegeta vegeta github.com/tsenart/vegeta/v12 "-s -w -X main.Version=$VEGETA_VERSION"

"$OUT/vegeta" -version 2>&1 | sed -n 1p >&2
echo "$OUT"
