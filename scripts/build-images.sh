#!/bin/sh
# `make images`: builds the five service images and the tiers image (batch runner, nearline worker) with
# whatever engine is here (docker with a running
# daemon, else podman, else buildah). Each image holds only its service's dependencies.
#
#   AIWORKS_TAG          image tag (default: the chart's appVersion, 0.1.0)
#   AIWORKS_REGISTRY     prefix, e.g. registry.example.com/team (default: none)
#   AIWORKS_BASE_IMAGE   PYTHON_IMAGE build argument (default: the Dockerfiles' official Python image);
#                        `scripts/build-base-image.sh python` makes one from Debian's packages
#   AIWORKS_IMAGES       which ones (default: gateway scheduler model-runtime cache monitor tiers)
#   ENGINE               force docker, podman or buildah
set -eu

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
TAG=${AIWORKS_TAG:-0.1.0}
PREFIX=${AIWORKS_REGISTRY:+$AIWORKS_REGISTRY/}aiworks
IMAGES=${AIWORKS_IMAGES:-gateway scheduler model-runtime cache monitor tiers}

if [ -z "${ENGINE:-}" ]; then
    if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
        ENGINE=docker
    elif command -v podman >/dev/null 2>&1; then
        ENGINE=podman
    elif command -v buildah >/dev/null 2>&1; then
        ENGINE=buildah
    else
        echo "no container engine: install docker (with its daemon running), podman or buildah" >&2
        exit 1
    fi
fi

set --
if [ -n "${AIWORKS_BASE_IMAGE:-}" ]; then
    set -- "$@" --build-arg "PYTHON_IMAGE=$AIWORKS_BASE_IMAGE"
fi
case "$ENGINE" in
    podman|buildah)
        # Hosts like these (hybrid cgroups, no systemd session): runc, no default ulimits.
        export CONTAINERS_CONF="${CONTAINERS_CONF:-$ROOT/deploy/images/containers.conf}"
        set -- "$@" --network host
        # Behind a TLS-inspecting proxy (PIP_CERT names its CA bundle, as on these machines): pip in the
        # build trusts the same bundle. Nothing of it stays in the images.
        if [ -n "${PIP_CERT:-}" ] && [ -f "$PIP_CERT" ]; then
            PIP_CONF=$(mktemp)
            printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$PIP_CONF"
            chmod 0644 "$PIP_CONF"
            trap 'rm -f "$PIP_CONF"' EXIT
            set -- "$@" --volume "$PIP_CERT:/etc/ssl/certs/ca-certificates.crt:ro" --volume "$PIP_CONF:/etc/pip.conf:ro"
        fi
        # The machine's pip cache, so rebuilds download nothing they already have.
        PIP_CACHE=${AIWORKS_PIP_CACHE:-${HOME:-/root}/.cache/pip}
        if [ -d "$PIP_CACHE" ]; then
            set -- "$@" --volume "$PIP_CACHE:/root/.cache/pip"
        fi
        ;;
esac
BUILD="$ENGINE build"
[ "$ENGINE" = buildah ] && BUILD="buildah bud"

for image in $IMAGES; do
    case "$image" in
        model-runtime) folder=model-runtime ;;
        gateway|scheduler|cache|monitor|tiers) folder=$image ;;
        *) echo "unknown image '$image'" >&2; exit 2 ;;
    esac
    echo "==> $PREFIX/$image:$TAG ($ENGINE)" >&2
    # shellcheck disable=SC2086  # $BUILD is the engine and its verb
    nice -n 10 $BUILD "$@" -f "services/$folder/Dockerfile" -t "$PREFIX/$image:$TAG" .
done
echo "built: $(for image in $IMAGES; do printf '%s ' "$PREFIX/$image:$TAG"; done)" >&2
