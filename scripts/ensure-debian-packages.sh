#!/bin/sh
# Installs the Debian packages the test suite needs when they are missing:
# redis-server (tests/cache start a private one on a free port).
# Usage: scripts/ensure-debian-packages.sh   (as root, or with sudo available)
set -eu

if command -v redis-server >/dev/null 2>&1; then
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
echo "redis-server not found; installing the Debian package" >&2
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends redis-server
# The package may start a system service on 6379; the tests never use it.
command -v redis-server >/dev/null 2>&1
