#!/bin/sh
# Builds a local base image from Debian's packages (no image registry needed) and loads it into the
# container engine: what the image tests use as PYTHON_IMAGE, and the Redis and Prometheus images the
# compose file names. Cached: the root filesystem tarball is kept under .cache/images/, keyed by the
# suite and package list, so later runs only import it, and nothing is built when the engine has the image.
#
#   scripts/build-base-image.sh python       -> prints localhost/aiworks-python:<key>
#   scripts/build-base-image.sh redis        -> localhost/aiworks-redis:<key>
#   scripts/build-base-image.sh prometheus   -> localhost/aiworks-prometheus:<key>
#
# Needs mmdebstrap and podman (Debian packages) and root. ENGINE=podman|buildah|docker (default podman).
set -eu

KIND=${1:?usage: build-base-image.sh python|redis|prometheus}
SUITE=${AIWORKS_BASE_SUITE:-bookworm}
ENGINE=${ENGINE:-podman}
case "$KIND" in
    # The official Python image's essentials: an interpreter with venv and pip's needs, CA certificates,
    # useradd/groupadd for the image's user.
    python) PACKAGES="python3 python3-venv python-is-python3 ca-certificates passwd libgomp1" ;;
    redis) PACKAGES="redis-server passwd" ;;
    prometheus) PACKAGES="prometheus ca-certificates wget" ;;
    *) echo "unknown base image '$KIND'" >&2; exit 2 ;;
esac
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${AIWORKS_IMAGE_CACHE:-$ROOT/.cache/images}
KEY=$(printf '%s %s %s' "$SUITE" "$KIND" "$PACKAGES" | sha256sum | cut -c1-12)
TARBALL="$CACHE/$KIND-$SUITE-$KEY.tar"
IMAGE="localhost/aiworks-$KIND:$KEY"
MIRROR=${AIWORKS_DEBIAN_MIRROR:-http://deb.debian.org/debian}

# The engine already has it (the key names its contents): nothing to build.
if $ENGINE image exists "$IMAGE" 2>/dev/null || $ENGINE image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "$IMAGE"
    exit 0
fi
mkdir -p "$CACHE"
if [ ! -s "$TARBALL" ]; then
    echo "building $TARBALL from Debian $SUITE: $PACKAGES" >&2
    nice -n 10 mmdebstrap --quiet --variant=minbase --include="$(echo "$PACKAGES" | tr ' ' ',')" \
        --customize-hook='rm -rf "$1"/var/cache/apt/archives/*.deb "$1"/var/lib/apt/lists/*' \
        "$SUITE" "$TARBALL.tmp.tar" "$MIRROR" >&2
    mv "$TARBALL.tmp.tar" "$TARBALL"
fi
if ! $ENGINE image exists "$IMAGE" 2>/dev/null && ! $ENGINE image inspect "$IMAGE" >/dev/null 2>&1; then
    case "$KIND" in
        python) CONFIG="--change=CMD [\"python3\"]" ;;
        redis) CONFIG="--change=CMD [\"redis-server\"]" ;;
        prometheus) CONFIG="--change=CMD [\"prometheus\"]" ;;
    esac
    $ENGINE import "$CONFIG" "$TARBALL" "$IMAGE" >&2
fi
echo "$IMAGE"
