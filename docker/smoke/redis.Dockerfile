# Redis for the smoke test only, built on the local Debian base because upstream images cannot be
# pulled there. compose.yaml names the real image (redis:7) for everyone else.
ARG BASE_IMAGE=kiln-smoke/base:bookworm
FROM ${BASE_IMAGE}
# Versions follow the base's Debian suite; pinning them would break on every security update.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/*
# The Debian package allocates the account's uid, so it can only be named.
# hadolint ignore=DL3066
USER redis
EXPOSE 6379
# A broker for a throwaway stack: no persistence, reachable from the compose network.
CMD ["redis-server", "--bind", "0.0.0.0", "--protected-mode", "no", "--save", "", "--appendonly", "no"]
