# syntax=docker/dockerfile:1
# The cdc-relay image: the release binary on a distroless base (glibc,
# CA certificates, no shell), running as an unprivileged user.
#
#   docker build --build-arg CDC_RELAY_GIT_COMMIT="$(git rev-parse --short=12 HEAD)" -t cdc-relay .
#
# The Rust version is rust-toolchain.toml's (deploy/check.sh checks they
# agree). Build and runtime stages use the same Debian release, so the
# binary's glibc matches.

ARG RUST_VERSION=1.95.0

FROM rust:${RUST_VERSION}-trixie AS build
ARG RUST_VERSION
# The build runs without .git: build.rs takes the commit from here.
ARG CDC_RELAY_GIT_COMMIT=unknown
ENV CDC_RELAY_GIT_COMMIT=${CDC_RELAY_GIT_COMMIT}
# Use the image's toolchain as it is: rust-toolchain.toml names the same
# version but also rustfmt and clippy, which a build does not need.
ENV RUSTUP_TOOLCHAIN=${RUST_VERSION}
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p cdc-relay \
    && install -D -m 0755 target/release/cdc-relay /out/cdc-relay

FROM gcr.io/distroless/cc-debian13:nonroot
COPY --from=build /out/cdc-relay /usr/local/bin/cdc-relay
# Numeric, so Kubernetes' runAsNonRoot can verify it (distroless "nonroot").
USER 65532:65532
# The admin endpoint (/metrics, /healthz, /readyz). The binary's default is
# loopback, unreachable from outside a container.
ENV CDC_RELAY_ADMIN_LISTEN=0.0.0.0:9187
EXPOSE 9187
ENTRYPOINT ["/usr/local/bin/cdc-relay"]
CMD ["run"]
