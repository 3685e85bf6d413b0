#!/usr/bin/env bash
# Build tollgate's container images as OCI image archives, without a container daemon:
#
#   tools/images/build.sh            # -> .cache/images/*.tar, digests in .cache/images/digests
#   ctr -n k8s.io images import .cache/images/tollgate-sidecar.tar    # on a node, or:
#   skopeo copy oci-archive:.cache/images/tollgate-sidecar.tar docker://registry.example/tollgate-sidecar:0.1.0
#
# Images (all single-layer, reproducible: same commit, same digest):
#   ghcr.io/tollgate-dev/tollgate-sidecar:<version>     release binary + its glibc libraries,
#   ghcr.io/tollgate-dev/tollgate-controller:<version>  CA certificates, user 65532, no shell
#   ghcr.io/tollgate-dev/tollgate-ratelimit:<version>   (the Envoy rate limit service)
#   tollgate.test/pause:1     pod sandbox for the test node (tools/images/pause)
#   tollgate.test/app:1       busybox httpd, for test Deployments (listens where its args say)
#   tollgate.test/redis:7     Debian's redis-server, for the chart's dev Redis in tests
#
# Env: IMAGES_OUT (default <repo>/.cache/images), IMAGES_PROFILE (cargo profile, default
# release), IMAGE_REGISTRY (default ghcr.io/tollgate-dev), IMAGES_ONLY (space-separated subset).
# The Dockerfile describes the same three product images for users with a container engine; a
# test (tests/node/test_images.py) checks that both agree.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
OUT=${IMAGES_OUT:-$ROOT/.cache/images}
PROFILE=${IMAGES_PROFILE:-release}
REGISTRY=${IMAGE_REGISTRY:-ghcr.io/tollgate-dev}
ONLY=${IMAGES_ONLY:-tollgate-sidecar tollgate-controller tollgate-ratelimit pause app redis}
log() { printf '[images] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
want() { [[ " $ONLY " == *" $1 "* ]]; }
mkdir -p "$OUT"

VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/Cargo.toml" | head -n 1)
REVISION=$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)
# Every timestamp in the images is the commit's, so the digest depends on the commit only.
CREATED=${SOURCE_DATE_EPOCH:-$(git -C "$ROOT" log -1 --format=%ct 2>/dev/null || echo 0)}
SOURCE=https://github.com/tollgate-dev/tollgate
LABELS=(--label "org.opencontainers.image.source=$SOURCE" --label "org.opencontainers.image.version=$VERSION"
        --label "org.opencontainers.image.revision=$REVISION" --label "org.opencontainers.image.licenses=Apache-2.0")
OCI=(python3 "$HERE/oci.py" --created "$CREATED")
: > "$OUT/digests.tmp"
record() { printf '%s %s %s\n' "$1" "$2" "$3" >> "$OUT/digests.tmp"; log "$1: $2 ($(du -h "$OUT/$1.tar" | cut -f1))"; }

# The product images: each package's binary (named like its package) and the same base.
PRODUCTS=() PACKAGES=()
for name in tollgate-sidecar tollgate-controller tollgate-ratelimit; do
  want "$name" && PRODUCTS+=("$name") && PACKAGES+=(-p "$name")
done
if [ ${#PRODUCTS[@]} -gt 0 ]; then
  log "cargo build --profile $PROFILE (${PRODUCTS[*]})"
  (cd "$ROOT" && cargo build --locked --profile "$PROFILE" "${PACKAGES[@]}") >&2
  dir=$PROFILE; [ "$PROFILE" = dev ] && dir=debug
  BIN="${CARGO_TARGET_DIR:-$ROOT/target}/$dir"
  for name in "${PRODUCTS[@]}"; do
    case $name in
      tollgate-sidecar) ports=(--expose 8081/tcp --expose 9091/tcp) ;;
      tollgate-controller) ports=(--expose 8090/tcp --expose 8443/tcp --expose 9090/tcp --expose 9443/tcp) ;;
      # gRPC (RLS v3 and RLQS) and admin: the chart's rateLimitService.port and .adminPort.
      tollgate-ratelimit) ports=(--expose 8081/tcp --expose 9091/tcp) ;;
    esac
    ref="$REGISTRY/$name:$VERSION"
    # Debug info stays in target/ for profiling; the image gets the stripped binary.
    strip --strip-debug -o "$OUT/.$name.bin" "$BIN/$name"
    d=$("${OCI[@]}" --name "$ref" --out "$OUT/$name.tar" \
        --file "$OUT/.$name.bin:/usr/local/bin/$name:755" --ldd "$BIN/$name" \
        --file /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:644 \
        --passwd --dir /tmp:1777 --dir /home/nonroot:755 \
        --user 65532:65532 --entrypoint "[\"/usr/local/bin/$name\"]" "${ports[@]}" "${LABELS[@]}" \
        --label "org.opencontainers.image.title=$name")
    record "$name" "$d" "$ref"
  done
fi

if want pause; then
  command -v go >/dev/null || die "go is needed to build the pause image"
  (cd "$HERE/pause" && CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-buildvcs=false \
     go build -trimpath -ldflags "-s -w" -o "$OUT/.pause.bin" .) >&2
  d=$("${OCI[@]}" --name tollgate.test/pause:1 --out "$OUT/pause.tar" \
      --file "$OUT/.pause.bin:/pause:755" --user 65535:65535 --entrypoint '["/pause"]' "${LABELS[@]}")
  record pause "$d" tollgate.test/pause:1
fi

if want app; then
  BB=/bin/busybox
  [ -x "$BB" ] && ! ldd "$BB" >/dev/null 2>&1 || die "$BB (static) missing: apt-get install busybox-static (tools/test-all.sh does)"
  printf 'hello from the test app\n' > "$OUT/.index.html"
  d=$("${OCI[@]}" --name tollgate.test/app:1 --out "$OUT/app.tar" \
      --file "$BB:/bin/busybox:755" --symlink /bin/sh:busybox --symlink /bin/httpd:busybox \
      --symlink /bin/sleep:busybox --symlink /bin/wget:busybox --symlink /bin/cat:busybox \
      --file "$OUT/.index.html:/www/index.html:644" --file "$OUT/.index.html:/www/global/index.html:644" \
      --passwd --dir /tmp:1777 \
      --user 65532:65532 --entrypoint '["/bin/httpd","-f","-h","/www"]' --cmd '["-p","0.0.0.0:8080"]' "${LABELS[@]}")
  record app "$d" tollgate.test/app:1
fi

if want redis; then
  RS=$(command -v redis-server) || die "redis-server missing: apt-get install redis-server (tools/test-all.sh does)"
  d=$("${OCI[@]}" --name tollgate.test/redis:7 --out "$OUT/redis.tar" \
      --file "$RS:/usr/bin/redis-server:755" --ldd "$RS" --passwd --dir /data:777 --dir /tmp:1777 \
      --user 999:999 --workdir /data --entrypoint '["/usr/bin/redis-server"]' --expose 6379/tcp "${LABELS[@]}")
  record redis "$d" tollgate.test/redis:7
fi

mv -f "$OUT/digests.tmp" "$OUT/digests"
echo "$PROFILE" > "$OUT/profile"
echo "$OUT"
