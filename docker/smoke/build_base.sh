#!/usr/bin/env bash
# Builds a minimal Debian + Python 3.11 root filesystem with debootstrap and writes it as a
# tarball that `docker import` turns into an image. The smoke test uses it as BASE_IMAGE (and as
# the base of its Redis and PostgreSQL images) on machines that cannot pull from any registry;
# it stands in for python:3.11-slim-bookworm, so it must keep `python3 -m venv` working.
#
#   docker/smoke/build_base.sh /var/cache/kiln-smoke/base-bookworm.tar
#
# Environment: KILN_BASE_SUITE (default bookworm, whose python3 is 3.11),
#              KILN_DEBIAN_MIRROR (default http://deb.debian.org/debian).
set -euo pipefail

out=${1:?usage: build_base.sh <output.tar>}
suite=${KILN_BASE_SUITE:-bookworm}
mirror=${KILN_DEBIAN_MIRROR:-http://deb.debian.org/debian}

if [ "$(id -u)" -ne 0 ]; then
  echo "build_base.sh: debootstrap needs root" >&2
  exit 2
fi
command -v debootstrap >/dev/null || { echo "build_base.sh: install debootstrap (apt-get install debootstrap)" >&2; exit 2; }

rootfs=$(mktemp -d "${TMPDIR:-/tmp}/kiln-base.XXXXXX")
trap 'rm -rf "$rootfs"' EXIT

# minbase: essential packages only; python3-venv brings ensurepip, which the images' `python3 -m venv` needs.
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$suite" "$rootfs" "$mirror" >&2

# Trust what this machine trusts: where HTTPS goes through an inspecting proxy, its CA is only in
# the host's bundle. Installed as a local CA (not over the bundle) so that a later
# update-ca-certificates in an image keeps it; pip uses its own certifi unless told otherwise.
if [ -s /etc/ssl/certs/ca-certificates.crt ]; then
  # One certificate per file, as update-ca-certificates (and its hash links) expect.
  awk -v dir="$rootfs/usr/local/share/ca-certificates" \
      '/-----BEGIN CERTIFICATE-----/ { n++; f = sprintf("%s/host-%03d.crt", dir, n) }
       f { print > f }
       /-----END CERTIFICATE-----/ { close(f); f = "" }' /etc/ssl/certs/ca-certificates.crt
  chroot "$rootfs" update-ca-certificates >/dev/null
  printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$rootfs/etc/pip.conf"
fi

# vfs copies every layer in full, so every megabyte here is paid once per layer of every image.
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/lib/apt/lists/* \
       "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/* \
       "$rootfs"/var/log/*.log "$rootfs"/var/log/apt/*
# Keep documentation out of later apt installs too (redis, postgres images).
cat > "$rootfs/etc/dpkg/dpkg.cfg.d/01-kiln-nodoc" <<'EOF'
path-exclude /usr/share/doc/*
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
EOF

# mktemp made the directory 0700, and it becomes the image's "/": non-root users could not
# reach a single file.
chmod 0755 "$rootfs"
mkdir -p "$(dirname "$out")"
tar --numeric-owner -C "$rootfs" -cf "$out.partial" .
mv "$out.partial" "$out"
echo "$out"
