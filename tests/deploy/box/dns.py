"""The box's cluster DNS: the names Kubernetes DNS gives Services and pods, answered over UDP.

Pods resolve cluster names as they do in Kubernetes: their ``/etc/resolv.conf``
names this server and the search list ``<ns>.svc.<domain> svc.<domain> <domain>``
with ``ndots:5``; their ``/etc/hosts`` holds only localhost and the pod itself.
A hosts file cannot stand in for DNS here: gRPC's resolver (c-ares) merges
hosts-file lines that share an address or a name, so once a headless Service's
name lists every pod, each pod's own name under it resolves to all of them.

Records (``records``), as the Kubernetes DNS specification lays them out:
``<svc>.<ns>.svc.<domain>`` is a Service's virtual IP, or for a headless
Service the addresses of the pods it selects (ready ones, or every one with
``publishNotReadyAddresses``); ``<hostname>.<svc>.<ns>.svc.<domain>`` is such
a pod whose subdomain is that Service (a StatefulSet's pods: hostname the pod's
name, subdomain the set's ``serviceName``). A and nothing else: other types
of a known name get an empty answer, unknown names NXDOMAIN (nothing is
forwarded; the box's pods reach nothing outside it).
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

TTL_S = 5  # short: a restarted pod's new address is seen within seconds
_A, _IN = 1, 1
_NXDOMAIN = 3
_FORMERR = 1


@dataclass(frozen=True)
class Member:
    """What DNS needs of a pod: its address, labels, readiness, and hostname/subdomain if it has them."""

    ip: str
    labels: dict[str, str]
    ready: bool
    hostname: str = ""
    subdomain: str = ""


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def records(namespace: str, domain: str, services: dict[str, dict], members: Iterable[Member],
            api_address: str) -> dict[str, list[str]]:  # fmt: skip
    """Every A record of the namespace: fully qualified name (lower case, no trailing dot) -> addresses.

    ``services``: name -> {"spec": the Service's spec, "address": its virtual IP, None when headless}.
    """
    members = list(members)
    out: dict[str, list[str]] = {f"kubernetes.default.svc.{domain}": [api_address]}
    for name, service in services.items():
        fqdn = f"{name}.{namespace}.svc.{domain}".lower()
        if service["address"]:
            out[fqdn] = [service["address"]]
            continue
        spec = service["spec"]
        chosen = [m for m in members if _selects(spec.get("selector") or {}, m.labels)
                  and (m.ready or spec.get("publishNotReadyAddresses"))]  # fmt: skip
        out[fqdn] = sorted({m.ip for m in chosen})
        for member in chosen:
            if member.hostname and member.subdomain == name:
                out[f"{member.hostname}.{fqdn}".lower()] = [member.ip]
    return out


def search_list(namespace: str, domain: str) -> list[str]:
    """The search domains the kubelet gives a pod (dnsPolicy ClusterFirst)."""
    return [f"{namespace}.svc.{domain}", f"svc.{domain}", domain]


def candidates(name: str, namespace: str, domain: str, ndots: int = 5) -> list[str]:
    """The names a pod's stub resolver asks for, in order, for ``name`` (resolv.conf's ndots rule)."""
    if name.endswith("."):
        return [name.rstrip(".")]
    searched = [f"{name}.{suffix}" for suffix in search_list(namespace, domain)]
    return [name, *searched] if name.count(".") >= ndots else [*searched, name]


def resolve(name: str, table: dict[str, list[str]], namespace: str, domain: str) -> list[str]:
    """What a pod gets for ``name``: the first candidate the table knows (an empty list: no such host)."""
    for candidate in candidates(name, namespace, domain):
        if candidate.lower() in table:
            return table[candidate.lower()]
    return []


def resolv_conf(nameserver: str, namespace: str, domain: str) -> str:
    return f"search {' '.join(search_list(namespace, domain))}\nnameserver {nameserver}\noptions ndots:5\n"


def _question(packet: bytes) -> tuple[str, int, int, int]:
    """(name, type, class, offset after the question) of a query's first question; ValueError if malformed."""
    labels, offset = [], 12
    while True:
        if offset >= len(packet):
            raise ValueError("truncated name")
        length = packet[offset]
        offset += 1
        if length == 0:
            break
        if length > 63 or offset + length > len(packet):
            raise ValueError("bad label")  # queries never compress their one name
        labels.append(packet[offset : offset + length].decode("ascii", "replace"))
        offset += length
    if offset + 4 > len(packet):
        raise ValueError("truncated question")
    qtype, qclass = struct.unpack("!HH", packet[offset : offset + 4])
    return ".".join(labels), qtype, qclass, offset + 4


def answer(packet: bytes, table: dict[str, list[str]]) -> bytes | None:
    """The reply to one query packet (None for what is not a query at all)."""
    if len(packet) < 12:
        return None
    ident, flags, qdcount = struct.unpack("!HHH", packet[:6])
    if flags & 0x8000:  # a response, not a query
        return None
    recursion = flags & 0x0100
    try:
        if qdcount != 1:
            raise ValueError("one question per query")
        name, qtype, qclass, end = _question(packet)
    except ValueError:
        return struct.pack("!HHHHHH", ident, 0x8000 | recursion | 0x0080 | _FORMERR, 0, 0, 0, 0)
    question = packet[12:end]
    addresses = table.get(name.lower().rstrip("."))
    rcode = _NXDOMAIN if addresses is None else 0
    rrs = b""
    count = 0
    if addresses and qtype == _A and qclass == _IN:
        for address in addresses:
            rrs += struct.pack("!HHHIH", 0xC00C, _A, _IN, TTL_S, 4) + socket.inet_aton(address)
            count += 1
    header = struct.pack("!HHHHHH", ident, 0x8000 | 0x0400 | recursion | 0x0080 | rcode, 1, count, 0, 0)
    return header + question + rrs


class DNSServer:
    """Answers A queries from ``table()`` (called per query, so it is always current) on ``address``:``port``."""

    def __init__(self, address: str, table: Callable[[], dict[str, list[str]]], port: int = 53):
        self.table = table
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._socket.bind((address, port))
        self._socket.settimeout(0.5)  # so close() is seen
        self.address, self.port = self._socket.getsockname()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="box-dns", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                packet, peer = self._socket.recvfrom(512)
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                reply = answer(packet, self.table())
                if reply is not None:
                    self._socket.sendto(reply, peer)
            except Exception:  # one bad packet or a table built mid-change: the client asks again
                continue

    def close(self) -> None:
        self._closed = True
        self._thread.join(2)
        self._socket.close()
