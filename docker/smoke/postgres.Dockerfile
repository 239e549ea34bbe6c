# PostgreSQL for the smoke test only, built on the local Debian base because upstream images
# cannot be pulled there. It honours the official image's POSTGRES_USER / POSTGRES_PASSWORD /
# POSTGRES_DB and data directory, so compose.yaml's settings and healthcheck apply unchanged.
ARG BASE_IMAGE=kiln-smoke/base:bookworm
FROM ${BASE_IMAGE}
# Versions follow the base's Debian suite; pinning them would break on every security update.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends postgresql \
    && rm -rf /var/lib/apt/lists/* \
    && install -d -o postgres -g postgres -m 0700 /var/lib/postgresql/data \
    && install -d -o postgres -g postgres /var/run/postgresql
COPY --chown=root:root postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint.sh
ENV PGDATA=/var/lib/postgresql/data
# The Debian package allocates the account's uid, so it can only be named.
# hadolint ignore=DL3066
USER postgres
EXPOSE 5432
ENTRYPOINT ["/usr/local/bin/postgres-entrypoint.sh"]
