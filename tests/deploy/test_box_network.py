"""The cluster in a box's pod network keeps the node's hardware address while pods come and go (box/network.py).

A Linux bridge whose address was never set takes the lowest of its ports' addresses. When a short-lived pod
(a `helm test` pod) had the lowest, the node's address changed under every pod and changed back when that pod
went: a pod that resolved the node (127.42.0.1, every Service IP) in between sent its packets to an address
nobody answered until its neighbour entry expired. The runtimes' heartbeats to the scheduler's Service were
lost, the scheduler expired both replicas, and the shared-limits check read hundreds of `no live replica`
(about one run in six on the 2-core VM; every run when each new port's address is the lowest).

Fast: a node and two pods in a throwaway network namespace, no processes served.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .box.network import BRIDGE_MAC

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    shutil.which("unshare") is None or shutil.which("nsenter") is None or os.geteuid() != 0,
    reason="the box's network needs root, util-linux's unshare and nsenter",
)

SCRIPT = r"""
import json, re, subprocess
from tests.deploy.box import network

def mac(device):
    shown = subprocess.run(["ip", "-o", "link", "show", device], capture_output=True, text=True, check=True).stdout
    return re.search(r"link/ether ([0-9a-f:]+)", shown).group(1)

node = network.Node()
seen, pods = [mac(network.BRIDGE)], []
try:  # each pod's namespace is held by a process: closed whatever happens
    pods += [node.add_pod() for _ in range(2)]
    seen.append(mac(network.BRIDGE))
    # A port whose address is lower than any other, as a short-lived pod's may be, joins and leaves.
    network.run("ip", "link", "add", "vlow", "type", "veth", "peer", "name", "vlowp")
    network.run("ip", "link", "set", "vlow", "address", "02:00:00:00:00:01")
    network.run("ip", "link", "set", "vlow", "master", network.BRIDGE, "up")
    seen.append(mac(network.BRIDGE))
    network.run("ip", "link", "del", "vlow")
    pods.pop().close()
    seen.append(mac(network.BRIDGE))
finally:
    for pod in pods:
        pod.close()
print(json.dumps(seen))
"""


def test_the_bridge_keeps_its_address_as_ports_come_and_go() -> None:
    done = subprocess.run(["unshare", "--net", sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == [BRIDGE_MAC] * 4, seen
