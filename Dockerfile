# Container images for tollgate-controller, tollgate-sidecar and tollgate-ratelimit (the Envoy
# rate limit service; one build, three targets), for users with a container engine:
#   docker build --target controller --build-arg REVISION=$(git rev-parse HEAD) -t ghcr.io/tollgate-dev/tollgate-controller:0.1.0 .
#   docker build --target sidecar    --build-arg REVISION=$(git rev-parse HEAD) -t ghcr.io/tollgate-dev/tollgate-sidecar:0.1.0 .
#   docker build --target ratelimit  --build-arg REVISION=$(git rev-parse HEAD) -t ghcr.io/tollgate-dev/tollgate-ratelimit:0.1.0 .
# Without one, tools/images/build.sh builds the same images as OCI archives (the project's tests
# use those; tests/node/test_images.py checks that this file describes the same binary path,
# entrypoint, user, ports and labels). Distroless base with glibc, non-root (65532), no shell;
# the chart runs them with a read-only root filesystem.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p tollgate-controller -p tollgate-sidecar -p tollgate-ratelimit

FROM gcr.io/distroless/cc-debian12:nonroot AS controller
ARG REVISION=unknown
LABEL org.opencontainers.image.source="https://github.com/tollgate-dev/tollgate" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.title="tollgate-controller"
COPY --from=build /src/target/release/tollgate-controller /usr/local/bin/tollgate-controller
USER 65532:65532
EXPOSE 8090/tcp 8443/tcp 9090/tcp 9443/tcp
ENTRYPOINT ["/usr/local/bin/tollgate-controller"]

# Before the sidecar: a build without --target still gives the sidecar image, as it did.
FROM gcr.io/distroless/cc-debian12:nonroot AS ratelimit
ARG REVISION=unknown
LABEL org.opencontainers.image.source="https://github.com/tollgate-dev/tollgate" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.title="tollgate-ratelimit"
COPY --from=build /src/target/release/tollgate-ratelimit /usr/local/bin/tollgate-ratelimit
USER 65532:65532
# gRPC (RLS v3 and RLQS) and admin, the chart's rateLimitService.port and .adminPort.
EXPOSE 8081/tcp 9091/tcp
ENTRYPOINT ["/usr/local/bin/tollgate-ratelimit"]

FROM gcr.io/distroless/cc-debian12:nonroot AS sidecar
ARG REVISION=unknown
LABEL org.opencontainers.image.source="https://github.com/tollgate-dev/tollgate" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.title="tollgate-sidecar"
COPY --from=build /src/target/release/tollgate-sidecar /usr/local/bin/tollgate-sidecar
USER 65532:65532
EXPOSE 8081/tcp 9091/tcp
ENTRYPOINT ["/usr/local/bin/tollgate-sidecar"]
