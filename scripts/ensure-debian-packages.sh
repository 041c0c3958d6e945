#!/bin/sh
# Installs the Debian packages the test suite needs when they are missing:
# - redis-server: tests/cache start a private one on a free port;
# - prometheus (prometheus and promtool): tests/observability check the rules
#   with promtool and start a private Prometheus on a free port.
# - podman, runc, catatonit (compose's `init: true`) and mmdebstrap: the image
#   tests build the service images and run docker-compose.yml with podman
#   (tests/deploy/test_images.py; deploy/images/containers.conf).
# - iproute2 and util-linux: the cluster-in-a-box test's network namespaces.
# Usage: scripts/ensure-debian-packages.sh   (as root, or with sudo available)
set -eu

# "command package" pairs: the package is installed when its command is missing.
NEEDED="redis-server:redis-server prometheus:prometheus promtool:prometheus podman:podman runc:runc catatonit:catatonit mmdebstrap:mmdebstrap ip:iproute2 unshare:util-linux nsenter:util-linux"

missing=""
for pair in $NEEDED; do
    command_name=${pair%%:*}
    package=${pair#*:}
    if ! command -v "$command_name" >/dev/null 2>&1; then
        case " $missing " in
            *" $package "*) ;;
            *) missing="$missing $package" ;;
        esac
    fi
done

if [ -z "$missing" ]; then
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
echo "installing missing Debian packages:$missing" >&2
$SUDO apt-get update -qq
# shellcheck disable=SC2086  # one word per package
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing
# The packages may start system services (Redis on 6379, Prometheus on 9090);
# the tests never use them: each starts its own on a free port.
for pair in $NEEDED; do
    command -v "${pair%%:*}" >/dev/null 2>&1
done
