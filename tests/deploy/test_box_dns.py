"""The cluster in a box names Services and StatefulSet pods as Kubernetes DNS does (tests/deploy/box/dns.py).

Fast: no box, no processes. The records come from the chart's own objects (two schedulers, a StatefulSet
under its headless Service); the wire check asks the box's DNS server through gRPC's own resolver (c-ares),
the resolver that got the box's old hosts file wrong (it merged the per-pod lines into the headless one).
"""

from __future__ import annotations

import socket
import struct
import threading
from typing import Any

import grpc
import pytest

from .box import dns
from .support import NAMESPACE, RELEASE

DOMAIN = "cluster.local"
SCHEDULER = f"{RELEASE}-scheduler"
HEADLESS = f"{SCHEDULER}-headless"
IPS = {f"{SCHEDULER}-0": "127.42.1.12", f"{SCHEDULER}-1": "127.42.1.13"}


def _ha_cluster(render: Any, ready: dict[str, bool]) -> tuple[dict[str, list[str]], Any]:
    """The records of a two-scheduler install: the rendered Services, the StatefulSet's pods at IPS."""
    rendered = render({"scheduler": {"replicas": 2}})
    services = {s["metadata"]["name"]: {"spec": s["spec"], "address": None if s["spec"].get("clusterIP") == "None"
                                        else f"127.42.100.{i + 10}"}
                for i, s in enumerate(rendered.of_kind("Service"))}  # fmt: skip
    statefulset = rendered.get("StatefulSet", SCHEDULER)
    labels = statefulset["spec"]["template"]["metadata"]["labels"]
    members = [
        dns.Member(ip, labels, ready[name], name, statefulset["spec"]["serviceName"]) for name, ip in IPS.items()
    ]
    return dns.records(NAMESPACE, DOMAIN, services, members, "127.42.100.2"), rendered


def test_each_scheduler_pod_resolves_to_itself_in_every_form_the_search_list_allows(render: Any) -> None:
    table, rendered = _ha_cluster(render, {f"{SCHEDULER}-0": True, f"{SCHEDULER}-1": True})
    for pod, ip in IPS.items():
        for name in (f"{pod}.{HEADLESS}", f"{pod}.{HEADLESS}.{NAMESPACE}", f"{pod}.{HEADLESS}.{NAMESPACE}.svc",
                     f"{pod}.{HEADLESS}.{NAMESPACE}.svc.{DOMAIN}", f"{pod}.{HEADLESS}.{NAMESPACE}.svc.{DOMAIN}."):  # fmt: skip
            assert dns.resolve(name, table, NAMESPACE, DOMAIN) == [ip], name
    # The addresses the chart gives runtimes and gateways: each one is exactly one scheduler pod.
    runtime = rendered.get("Deployment", f"{RELEASE}-runtime-iris-stable")["spec"]["template"]["spec"]["containers"][0]
    [addresses] = [e["value"] for e in runtime["env"] if e["name"] == "AIWORKS_RUNTIME_SCHEDULER_ADDRESS"]
    resolved = [dns.resolve(a.rsplit(":", 1)[0], table, NAMESPACE, DOMAIN) for a in addresses.split(",")]
    assert resolved == [[IPS[f"{SCHEDULER}-0"]], [IPS[f"{SCHEDULER}-1"]]]
    # The headless name is every pod; the ClusterIP Service its virtual IP; the API server its own.
    for name in (HEADLESS, f"{HEADLESS}.{NAMESPACE}.svc"):
        assert dns.resolve(name, table, NAMESPACE, DOMAIN) == sorted(IPS.values())
    assert dns.resolve(SCHEDULER, table, NAMESPACE, DOMAIN)[0].startswith("127.42.100.")
    assert dns.resolve("kubernetes.default", table, NAMESPACE, DOMAIN) == ["127.42.100.2"]
    assert dns.resolve(f"{SCHEDULER}-2.{HEADLESS}", table, NAMESPACE, DOMAIN) == []


def test_readiness_counts_only_where_the_service_says_so(render: Any) -> None:
    table, _ = _ha_cluster(render, {f"{SCHEDULER}-0": False, f"{SCHEDULER}-1": True})
    # The chart's headless Service publishes not-ready pods (a starting scheduler gets its runtimes first).
    assert table[f"{HEADLESS}.{NAMESPACE}.svc.{DOMAIN}"] == sorted(IPS.values())
    assert table[f"{SCHEDULER}-0.{HEADLESS}.{NAMESPACE}.svc.{DOMAIN}"] == [IPS[f"{SCHEDULER}-0"]]
    spec = {"clusterIP": "None", "selector": {"app": "x"}, "ports": [{"port": 1}]}
    members = [dns.Member("127.42.1.20", {"app": "x"}, False, "x-0", "plain"),
               dns.Member("127.42.1.21", {"app": "x"}, True, "x-1", "plain")]  # fmt: skip
    plain = dns.records(NAMESPACE, DOMAIN, {"plain": {"spec": spec, "address": None}}, members, "127.42.100.2")
    assert plain[f"plain.{NAMESPACE}.svc.{DOMAIN}"] == ["127.42.1.21"]
    assert f"x-0.plain.{NAMESPACE}.svc.{DOMAIN}" not in plain
    assert dns.resolv_conf("127.42.100.3", NAMESPACE, DOMAIN).splitlines() == [
        f"search {NAMESPACE}.svc.{DOMAIN} svc.{DOMAIN} {DOMAIN}",
        "nameserver 127.42.100.3",
        "options ndots:5",
    ]


def _query(server: dns.DNSServer, name: str, qtype: int = 1) -> tuple[int, list[str]]:
    question = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0" + struct.pack("!HH", qtype, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(5)
        sock.sendto(struct.pack("!HHHHHH", 7, 0x0100, 1, 0, 0, 0) + question, (server.address, server.port))
        reply = sock.recv(512)
    ident, flags, _, count = struct.unpack("!HHHH", reply[:8])
    assert ident == 7 and flags & 0x8000
    body = reply[12 + len(question) :]
    return flags & 0xF, [socket.inet_ntoa(body[i * 16 + 12 : i * 16 + 16]) for i in range(count)]


@pytest.fixture
def server(render: Any):
    table, _ = _ha_cluster(render, {f"{SCHEDULER}-0": True, f"{SCHEDULER}-1": True})
    server = dns.DNSServer("127.0.0.1", lambda: table, port=0)
    yield server
    server.close()


def test_the_server_answers_a_records_and_nxdomain(server: dns.DNSServer) -> None:
    fqdn = f"{SCHEDULER}-1.{HEADLESS}.{NAMESPACE}.svc.{DOMAIN}"
    assert _query(server, fqdn) == (0, [IPS[f"{SCHEDULER}-1"]])
    assert _query(server, fqdn.upper()) == (0, [IPS[f"{SCHEDULER}-1"]])
    assert _query(server, f"{HEADLESS}.{NAMESPACE}.svc.{DOMAIN}") == (0, sorted(IPS.values()))
    assert _query(server, fqdn, qtype=28) == (0, [])  # AAAA of a known name: no data, not NXDOMAIN
    assert _query(server, f"nothing.{NAMESPACE}.svc.{DOMAIN}") == (3, [])


def test_grpc_reaches_the_pod_it_names_through_the_box_dns(server: dns.DNSServer) -> None:
    """gRPC's c-ares resolver, asked through this server, connects each per-pod name to that pod only."""
    reached: list[str] = []
    listeners = []
    for ip in IPS.values():  # 127.0.0.0/8 is this machine's loopback: each pod address can listen here
        listener = socket.create_server((ip, 0))
        listeners.append(listener)
    port = listeners[0].getsockname()[1]
    listeners[1].close()
    listeners[1] = socket.create_server((IPS[f"{SCHEDULER}-1"], port))

    def accept(listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            reached.append(conn.getsockname()[0])
            conn.close()

    for listener in listeners:
        threading.Thread(target=accept, args=(listener,), daemon=True).start()
    try:
        for pod, ip in IPS.items():
            reached.clear()
            target = f"dns://{server.address}:{server.port}/{pod}.{HEADLESS}.{NAMESPACE}.svc.{DOMAIN}:{port}"
            with grpc.insecure_channel(target, options=[("grpc.dns_enable_srv_queries", 0)]) as channel:
                with pytest.raises(grpc.FutureTimeoutError):  # the listeners speak no HTTP/2; the dial is what counts
                    grpc.channel_ready_future(channel).result(timeout=2)
            assert reached and set(reached) == {ip}, (pod, reached)
    finally:
        for listener in listeners:
            listener.close()
