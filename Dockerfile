# Multi-stage build: compile delayd, run it as a non-root user with the WAL
# on a volume.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
# OpenSSL and libcurl for librdkafka's TLS, SASL and OIDC.
RUN bash scripts/build-deps.sh && cargo build --release --locked && strip target/release/delayd

FROM debian:bookworm-slim
# libssl3 and libcurl4: librdkafka's TLS, SASL and OIDC; ca-certificates:
# the CAs of brokers with public certificates.
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates curl libssl3 libcurl4 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --home /var/lib/delayd delayd \
    && mkdir -p /var/lib/delayd/wal /etc/delayd && chown -R delayd /var/lib/delayd
COPY --from=build /src/target/release/delayd /usr/local/bin/delayd
COPY config/delayd.toml /etc/delayd/delayd.toml
USER delayd
ENV DELAYD_WAL__DIR=/var/lib/delayd/wal
VOLUME ["/var/lib/delayd"]
EXPOSE 9464
HEALTHCHECK --interval=10s --timeout=3s CMD curl -fsS http://127.0.0.1:9464/healthz || exit 1
ENTRYPOINT ["delayd"]
CMD ["run", "--config", "/etc/delayd/delayd.toml"]
