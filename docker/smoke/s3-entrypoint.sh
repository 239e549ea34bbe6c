#!/bin/sh
# Run SeaweedFS (master, volume, filer and S3 gateway in one process) with one identity made of
# MinIO's root credentials (the password from MINIO_ROOT_PASSWORD or the file
# MINIO_ROOT_PASSWORD_FILE names, as MinIO takes it); like AWS, a missing bucket is an error
# (s3-init creates them).
set -eu
if [ -n "${MINIO_ROOT_PASSWORD_FILE:-}" ]; then
  MINIO_ROOT_PASSWORD=$(cat "$MINIO_ROOT_PASSWORD_FILE")
fi
: "${MINIO_ROOT_USER:?set MINIO_ROOT_USER}" "${MINIO_ROOT_PASSWORD:?set MINIO_ROOT_PASSWORD or MINIO_ROOT_PASSWORD_FILE}"
config=/data/s3.json
printf '{"identities": [{"name": "root", "credentials": [{"accessKey": "%s", "secretKey": "%s"}], "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}\n' \
  "$MINIO_ROOT_USER" "$MINIO_ROOT_PASSWORD" > "$config"
export TMPDIR=/data  # its log files go to the volume
exec weed server -dir=/data -ip=127.0.0.1 -ip.bind=0.0.0.0 \
  -master.volumeSizeLimitMB=64 -volume.max=0 -filer \
  -s3 -s3.port=9000 -s3.autoCreateBucket=false -s3.port.iceberg=0 -s3.port.lance=0 \
  -s3.config="$config"
