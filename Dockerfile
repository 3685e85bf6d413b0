# Container images for tollgate-controller and tollgate-sidecar (one build, two targets):
#   docker build --target controller -t ghcr.io/tollgate-dev/tollgate-controller:0.1.0 .
#   docker build --target sidecar    -t ghcr.io/tollgate-dev/tollgate-sidecar:0.1.0 .
# Static-free distroless base, non-root (65532), no shell; the chart runs them with a read-only
# root filesystem. (There is no container engine on the development machine, so this file is
# not exercised by the test suite.)
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p tollgate-controller -p tollgate-sidecar

FROM gcr.io/distroless/cc-debian12:nonroot AS controller
COPY --from=build /src/target/release/tollgate-controller /usr/local/bin/tollgate-controller
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/tollgate-controller"]

FROM gcr.io/distroless/cc-debian12:nonroot AS sidecar
COPY --from=build /src/target/release/tollgate-sidecar /usr/local/bin/tollgate-sidecar
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/tollgate-sidecar"]
