#!/usr/bin/env bash
# Builds Rill's image with podman from Debian's and PyPI's packages alone, for hosts that reach no container
# registry: the base image comes from mmdebstrap (Debian bookworm, python3 and its venv module), then the
# repository's Dockerfile builds on it (BASE_IMAGE). Run as root, from anywhere:
#
#   deploy/image/build.sh [TAG]        # TAG: localhost/rill:0.1.0 unless given
#
# Needs podman, mmdebstrap and runc (apt-get install podman mmdebstrap runc) and, on hosts with a hybrid cgroup
# layout, deploy/image/containers.conf as /etc/containers/containers.conf (docs/deployment.md, "Podman").
# Idempotent: an existing base is kept (its tag names the package list it was made from) and podman reuses
# every cached layer whose inputs did not change.
set -euo pipefail
cd "$(dirname "$0")/../.."

tag="${1:-localhost/rill:0.1.0}"
# The packages the Dockerfile expects of its base; minbase is the variant Docker's debian:bookworm images use.
mirrors=(
  "deb http://deb.debian.org/debian bookworm main"
  "deb http://deb.debian.org/debian bookworm-updates main"
  "deb http://deb.debian.org/debian-security bookworm-security main"
)
mmdebstrap_args=(--variant=minbase --include=python3,python3-venv,ca-certificates bookworm - "${mirrors[@]}")
base="localhost/rill-base:bookworm-$(printf '%s\n' "${mmdebstrap_args[@]}" | sha256sum | cut -c1-12)"

if podman image exists "$base"; then
  echo "==> base image $base (kept)"
else
  echo "==> base image $base: mmdebstrap ${mmdebstrap_args[*]}"
  mmdebstrap "${mmdebstrap_args[@]}" | podman import --quiet - "$base"
fi

# Builds fetch from PyPI and crates.io over TLS with this host's CA bundle (which may hold a proxy's CA):
# mounted read-only into every RUN step, with a pip.conf pointing at it. Mounts never enter the image's layers.
ca_bundle=/etc/ssl/certs/ca-certificates.crt
pip_conf="$(mktemp)"
trap 'rm -f "$pip_conf"' EXIT
printf '[global]\ncert = %s\n' "$ca_bundle" >"$pip_conf"
chmod 644 "$pip_conf"

echo "==> image $tag: podman build on $base"
# Docker's image format: OCI's has no SHELL or HEALTHCHECK, and podman would drop the Dockerfile's.
# Two jobs: the runtime stage downloads torch while the build stage compiles the router.
podman build --format docker --jobs 2 --network host --layers \
  --volume "$ca_bundle:$ca_bundle:ro" --volume "$pip_conf:/etc/pip.conf:ro" \
  --build-arg "BASE_IMAGE=$base" --tag "$tag" .
podman image inspect --format '==> {{index .RepoTags 0}}: {{.Size}} bytes' "$tag"
