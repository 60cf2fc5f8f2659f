# Multi-stage build: compile delayd, run it as a non-root user with the WAL
# on a volume. The user is numeric (10001:10001) so Kubernetes can check
# `runAsNonRoot` without a `runAsUser`; the health check is delayd's own
# (`delayd healthcheck`), so the image carries no curl.
#
# scripts/image.sh builds the same layout without a Docker engine (buildah
# on a debootstrap root) and runs it in the test command.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
# OpenSSL and libcurl for librdkafka's TLS, SASL and OIDC.
RUN bash scripts/build-deps.sh && cargo build --release --locked && strip target/release/delayd

FROM debian:bookworm-slim
# libssl3 and libcurl4: librdkafka's TLS, SASL and OIDC; ca-certificates:
# the CAs of brokers with public certificates.
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates libssl3 libcurl4 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 delayd \
    && useradd --system --uid 10001 --gid 10001 --home /var/lib/delayd --shell /usr/sbin/nologin delayd \
    && mkdir -p /var/lib/delayd/wal /etc/delayd && chown -R 10001:10001 /var/lib/delayd
COPY --from=build /src/target/release/delayd /usr/local/bin/delayd
COPY config/delayd.toml /etc/delayd/delayd.toml
USER 10001:10001
ENV DELAYD_CONFIG=/etc/delayd/delayd.toml \
    DELAYD_WAL__DIR=/var/lib/delayd/wal
VOLUME ["/var/lib/delayd"]
EXPOSE 9464
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s CMD ["delayd", "healthcheck", "--timeout", "2s"]
ENTRYPOINT ["delayd"]
CMD ["run"]
