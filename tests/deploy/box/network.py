"""The box's pod network: one network namespace per pod on a bridge, all on loopback addresses.

The box's own process is the node: it runs in a network namespace of its
own (``unshare --net``), holds the bridge, the Services' virtual IPs and
the fake API server. Each pod gets a namespace (held by a ``sleep``), a veth
into the bridge and an address in 127.42.0.0/16. Loopback addresses do not
normally leave ``lo``; ``route_localnet`` and dropping the ``local
127.0.0.0/8`` route let them travel between these namespaces, so no address
outside 127.0.0.0/8 is ever used, and nothing leaves the node namespace.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import subprocess
import time
from dataclasses import dataclass

NODE_ADDRESS = "127.42.0.1"
PREFIX = 16
POD_RANGE = ipaddress.ip_network("127.42.1.0/24")
SERVICE_RANGE = ipaddress.ip_network("127.42.100.0/24")
BRIDGE = "box0"
BRIDGE_MAC = "02:42:7f:2a:00:01"  # locally administered


def run(*command: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")


def _sysctls(prefix: list[str], interfaces: list[str]) -> None:
    for interface in ["all", "default", *interfaces]:
        run(*prefix, "sysctl", "-qw", f"net.ipv4.conf.{interface}.route_localnet=1")
        run(*prefix, "sysctl", "-qw", f"net.ipv4.conf.{interface}.rp_filter=0")


def _loopback_only_on_lo(prefix: list[str]) -> None:
    """127/8 is local on lo by default; keep only 127.0.0.1 there so 127.42/16 is routed on the veth."""
    run(*prefix, "ip", "route", "del", "local", "127.0.0.0/8", "dev", "lo", "table", "local")
    subprocess.run([*prefix, "ip", "route", "del", "broadcast", "127.255.255.255", "dev", "lo", "table", "local"],
                   capture_output=True)  # fmt: skip


class Node:
    """This process's namespace as the node: the bridge and address allocation."""

    def __init__(self) -> None:
        self._pods = (str(a) for a in POD_RANGE.hosts() if a.packed[-1] >= 2)
        self._services = (str(a) for a in SERVICE_RANGE.hosts() if a.packed[-1] >= 2)
        self._veths = itertools.count()
        run("ip", "link", "set", "lo", "up")
        run("ip", "link", "add", BRIDGE, "type", "bridge")
        # A bridge whose address was never set takes the lowest of its ports' addresses, so it changes as pods
        # come and go. A pod that resolved the node's address (127.42.0.1, every Service IP) while a short-lived
        # pod's port was the lowest then sends to an address nobody answers once that pod is gone, until its
        # neighbour entry expires: tens of seconds without the scheduler (heartbeats lost, replicas expired).
        # An address set by hand never changes (as docker0 and the CNI bridge plugin set theirs).
        run("ip", "link", "set", BRIDGE, "address", BRIDGE_MAC)
        _sysctls([], [BRIDGE])
        _loopback_only_on_lo([])
        run("ip", "addr", "add", f"{NODE_ADDRESS}/{PREFIX}", "dev", BRIDGE)
        run("ip", "link", "set", BRIDGE, "up")

    def service_address(self) -> str:
        """A virtual IP for a Service, on the bridge (the node answers for it)."""
        address = next(self._services)
        run("ip", "addr", "add", f"{address}/32", "dev", BRIDGE)
        return address

    def add_pod(self) -> PodNetwork:
        holder = subprocess.Popen(["unshare", "--net", "sleep", "infinity"], stdin=subprocess.DEVNULL)
        netns = f"/proc/{holder.pid}/ns/net"
        mine = os.readlink("/proc/self/ns/net")
        deadline = time.monotonic() + 5
        while os.readlink(netns) == mine:  # until unshare is in the new namespace
            if time.monotonic() > deadline:
                raise RuntimeError("unshare --net did not make a namespace")
            time.sleep(0.005)
        address = next(self._pods)
        n = next(self._veths)
        host_side, pod_side = f"vh{n}", f"vp{n}"
        run("ip", "link", "add", host_side, "type", "veth", "peer", "name", pod_side)
        run("ip", "link", "set", host_side, "master", BRIDGE, "up")
        run("ip", "link", "set", pod_side, "netns", str(holder.pid))
        inside = ["nsenter", f"--net={netns}"]
        run(*inside, "ip", "link", "set", "lo", "up")
        run(*inside, "ip", "link", "set", pod_side, "name", "eth0")
        _sysctls(inside, ["eth0"])
        _loopback_only_on_lo(inside)
        run(*inside, "ip", "addr", "add", f"{address}/{PREFIX}", "dev", "eth0")
        run(*inside, "ip", "link", "set", "eth0", "up")
        return PodNetwork(address, holder, host_side)


@dataclass
class PodNetwork:
    """One pod's namespace: its address, the process holding it, and its veth on the bridge."""

    address: str
    holder: subprocess.Popen
    veth: str

    @property
    def netns(self) -> str:
        return f"/proc/{self.holder.pid}/ns/net"

    def close(self) -> None:
        self.holder.kill()
        self.holder.wait()
        subprocess.run(["ip", "link", "del", self.veth], capture_output=True)
