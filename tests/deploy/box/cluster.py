"""A cluster in a box: install a rendered chart as Helm would, with every workload as local processes.

``Box.install(manifests)`` follows ``helm install``: pre-install hooks by
weight (hook Jobs run to completion), then the release's objects (Services
get virtual IPs, Deployments and StatefulSets their pods), then
post-install hooks; ``helm_test()`` runs the test hooks. Pods are
``kubelet.Pod``s; Services are proxied (``proxy.py``) and named by the
box's cluster DNS (``dns.py``, which every pod's ``/etc/resolv.conf``
names); the API server is the thin stand-in of
``apiserver.py``. The box must run in a network namespace of its own
(``python -m tests.deploy.box`` arranges that): its namespace is the node.

For scenarios: ``pods(component)``, ``service_address(name)``,
``delete_pod`` (a Deployment replaces it), ``Pod.kill``, ``wait_ready``,
``add_claim`` and ``api.put_secret`` for what an operator creates first.
"""

from __future__ import annotations

import hashlib
import itertools
import secrets as random
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from aiworks.security.certs import write_certificates

from . import dns
from .apiserver import FakeAPIServer
from .kubelet import Pod
from .network import Node
from .proxy import ServiceProxy

WORKLOADS = ("Deployment", "StatefulSet")


def hook_of(obj: dict) -> list[str]:
    hooks = (obj["metadata"].get("annotations") or {}).get("helm.sh/hook", "")
    return [h.strip() for h in hooks.split(",") if h.strip()]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


class Box:
    """One namespace of a cluster, on this machine."""

    def __init__(self, workdir: Path, namespace: str = "aiworks", domain: str = "cluster.local"):
        self.workdir = workdir
        self.namespace = namespace
        self.domain = domain
        self.node = Node()
        self.proxy = ServiceProxy()
        self.api_address = self.node.service_address()
        certs = write_certificates(workdir / "apiserver", [self.api_address, "kubernetes", "kubernetes.default",
                                                           "kubernetes.default.svc", f"kubernetes.default.svc.{domain}"])
        self.api_ca = certs.ca_cert
        self._tokens: dict[str, str] = {}  # account -> token
        self.accounts: set[str] = {"default"}
        self.api = FakeAPIServer(
            self.api_address, certs.server_dir / "tls.crt", certs.server_dir / "tls.key", {},
            pods=lambda: [p.as_api_object() for p in self.pods if not p.deleted and p.kind in WORKLOADS],
            deployments=self._deployments_for_api, delete_pod=self.delete_pod, scale=self.scale,
        )  # fmt: skip
        self.objects: list[dict] = []
        self.config_maps: dict[str, dict[str, str]] = {}
        self.services: dict[str, dict] = {}  # name -> {"spec": ..., "address": VIP or None}
        self.workloads: dict[str, dict] = {}  # name -> object (replicas resolved)
        self.pods: list[Pod] = []
        self.claims: dict[str, Path] = {}
        self.events: list[str] = []
        self._lock = threading.Lock()
        self._names = itertools.count()
        self.dns = dns.DNSServer(self.node.service_address(), self.dns_records)  # kube-dns's virtual IP

    # ---- what exists before the install (an operator's objects) ----------------------------------

    def add_claim(self, name: str) -> Path:
        """A bound PersistentVolumeClaim: a folder its pods mount."""
        folder = self.workdir / "claims" / name
        folder.mkdir(parents=True, exist_ok=True)
        self.claims[name] = folder
        return folder

    def claim(self, name: str) -> Path:
        if name not in self.claims:
            raise RuntimeError(f'persistentvolumeclaim "{name}" not found')
        return self.claims[name]

    # ---- helm install ---------------------------------------------------------------------------

    def install(self, manifests: dict[str, str], *, wait: bool = False, timeout_s: float = 300) -> None:
        objects = [o for path, text in sorted(manifests.items()) if path.endswith(".yaml")
                   for o in yaml.safe_load_all(text) if o]  # fmt: skip
        self.objects = objects
        hooks = [o for o in objects if hook_of(o)]
        self._run_hooks([o for o in hooks if "pre-install" in hook_of(o)], timeout_s)
        release = [o for o in objects if not hook_of(o)]
        for obj in release:
            kind, name = obj["kind"], obj["metadata"]["name"]
            if kind == "ConfigMap":
                self.config_maps[name] = dict(obj.get("data") or {})
            elif kind == "Secret":
                self.api.put_secret(self.namespace, name, {k: v.encode() for k, v in (obj.get("stringData") or {}).items()})
            elif kind == "ServiceAccount":
                self.accounts.add(name)
        for obj in release:
            if obj["kind"] == "Service":
                self._add_service(obj)
        for obj in release:
            if obj["kind"] in WORKLOADS:
                self._add_workload(obj, objects)
        self._run_hooks([o for o in hooks if "post-install" in hook_of(o)], timeout_s)
        if wait:
            self.wait_ready(timeout_s)

    def _run_hooks(self, hooks: list[dict], timeout_s: float) -> None:
        order = {"ServiceAccount": 0, "Role": 1, "RoleBinding": 2, "Job": 9, "Pod": 9}
        for obj in sorted(hooks, key=lambda o: (int(o["metadata"]["annotations"].get("helm.sh/hook-weight", "0")),
                                                order.get(o["kind"], 5))):  # fmt: skip
            kind, name = obj["kind"], obj["metadata"]["name"]
            if kind == "ServiceAccount":
                self.accounts.add(name)
            elif kind in ("Job", "Pod"):
                code, logs = self._run_to_completion(obj, timeout_s)
                if code != 0:
                    raise RuntimeError(f"hook {kind}/{name} failed (exit {code}):\n{logs}")
                self.events.append(f"hook {kind}/{name} succeeded")

    def _run_to_completion(self, obj: dict, timeout_s: float) -> tuple[int | None, str]:
        template = obj["spec"]["template"] if obj["kind"] == "Job" else obj
        name = obj["metadata"]["name"] + ("-" + random.token_hex(3) if obj["kind"] == "Job" else "")
        pod = self._new_pod(name, template, obj["metadata"]["name"], obj["kind"])
        code = pod.wait_done(timeout_s)
        logs = pod.logs()
        if pod.phase == "Failed" and code is None:
            code = -1
            logs = f"{pod.reason}\n{logs}"
        pod.stop()
        return code, logs

    def helm_test(self, timeout_s: float = 300) -> tuple[bool, str]:
        """`helm test`: every test hook pod to completion; (all succeeded, their logs)."""
        ok, out = True, []
        for obj in (o for o in self.objects if "test" in hook_of(o) and o["kind"] == "Pod"):
            code, logs = self._run_to_completion(obj, timeout_s)
            ok = ok and code == 0
            out.append(f"{obj['metadata']['name']}: exit {code}\n{logs}")
        return ok, "\n".join(out)

    # ---- Services ---------------------------------------------------------------------------------

    def _add_service(self, obj: dict) -> None:
        name, spec = obj["metadata"]["name"], obj["spec"]
        headless = spec.get("clusterIP") == "None"
        address = None if headless else self.node.service_address()
        self.services[name] = {"spec": spec, "address": address}
        if address is None:
            return
        for port in spec["ports"]:
            self.proxy.add(address, port["port"], lambda s=spec, p=port: self.endpoints(s, p))

    def endpoints(self, spec: dict, port: dict) -> list[tuple[str, int]]:
        """Ready pods the Service selects, with the target port (by name or number)."""
        out = []
        for pod in list(self.pods):
            if pod.deleted or pod.kind not in WORKLOADS or not selects(spec.get("selector", {}), pod.labels):
                continue
            if not (pod.ready or spec.get("publishNotReadyAddresses")):
                continue
            target = port.get("targetPort", port["port"])
            if isinstance(target, str) and not target.isdigit():
                numbers = [p["containerPort"] for c in pod.containers for p in c.spec.get("ports", []) if p["name"] == target]
                if not numbers:
                    continue
                target = numbers[0]
            out.append((pod.ip, int(target)))
        return out

    def service_address(self, name: str) -> str:
        return self.services[name]["address"]

    def _dns_member(self, pod: Pod) -> dns.Member:
        """A StatefulSet's pod has its name as hostname and the set's serviceName as subdomain (as the
        StatefulSet controller sets them); other pods what their spec says."""
        hostname, subdomain = pod.spec.get("hostname", ""), pod.spec.get("subdomain", "")
        owner = self.workloads.get(pod.owner)
        if owner is not None and owner["kind"] == "StatefulSet":
            hostname, subdomain = pod.name, owner["spec"].get("serviceName", "")
        return dns.Member(pod.ip, dict(pod.labels), pod.ready, hostname, subdomain)

    def dns_records(self) -> dict[str, list[str]]:
        """The namespace's A records as Kubernetes DNS serves them now (``dns.records``)."""
        members = [self._dns_member(p) for p in list(self.pods) if not p.deleted and p.kind in WORKLOADS]
        return dns.records(self.namespace, self.domain, dict(self.services), members, self.api_address)

    def write_hosts(self, pod: Pod, hosts: Path, resolv: Path) -> None:
        """The pod's /etc/hosts as the kubelet writes it (localhost, the pod by its hostname, and its FQDN
        when it has a subdomain) and its /etc/resolv.conf (the cluster DNS, the search list, ndots:5)."""
        member = self._dns_member(pod)
        own = member.hostname or pod.name
        if member.subdomain:
            own = f"{own}.{member.subdomain}.{self.namespace}.svc.{self.domain} {own}"
        hosts.write_text(f"127.0.0.1 localhost\n{pod.ip} {own}\n")
        resolv.write_text(dns.resolv_conf(self.dns.address, self.namespace, self.domain))

    def kubernetes_env(self) -> dict[str, str]:
        a = self.api_address
        return {"KUBERNETES_SERVICE_HOST": a, "KUBERNETES_SERVICE_PORT": "443", "KUBERNETES_SERVICE_PORT_HTTPS": "443",
                "KUBERNETES_PORT": f"tcp://{a}:443", "KUBERNETES_PORT_443_TCP": f"tcp://{a}:443",
                "KUBERNETES_PORT_443_TCP_PROTO": "tcp", "KUBERNETES_PORT_443_TCP_PORT": "443",
                "KUBERNETES_PORT_443_TCP_ADDR": a}  # fmt: skip

    def service_links(self) -> dict[str, str]:
        """The docker-link style variables the kubelet adds when enableServiceLinks is true (its default)."""
        env = {}
        for name, service in self.services.items():
            if not service["address"]:
                continue
            prefix = name.upper().replace("-", "_")
            first = service["spec"]["ports"][0]
            env[f"{prefix}_SERVICE_HOST"] = service["address"]
            env[f"{prefix}_SERVICE_PORT"] = str(first["port"])
            env[f"{prefix}_PORT"] = f"tcp://{service['address']}:{first['port']}"
            for port in service["spec"]["ports"]:
                base = f"{prefix}_PORT_{port['port']}_TCP"
                env[base] = f"tcp://{service['address']}:{port['port']}"
                env.update({f"{base}_PROTO": "tcp", f"{base}_PORT": str(port["port"]), f"{base}_ADDR": service["address"]})
                if port.get("name"):
                    env[f"{prefix}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}"] = str(port["port"])
        return env

    # ---- workloads and pods -----------------------------------------------------------------------

    def _add_workload(self, obj: dict, objects: list[dict]) -> None:
        name = obj["metadata"]["name"]
        replicas = obj["spec"].get("replicas")
        if replicas is None:
            hpa = [o for o in objects if o["kind"] == "HorizontalPodAutoscaler"
                   and o["spec"]["scaleTargetRef"]["name"] == name]  # fmt: skip
            replicas = hpa[0]["spec"].get("minReplicas", 1) if hpa else 1
        obj = {**obj, "spec": {**obj["spec"], "replicas": replicas}}
        self.workloads[name] = obj
        for i in range(replicas):
            self._new_workload_pod(obj, i)

    def _new_workload_pod(self, obj: dict, ordinal: int) -> Pod:
        name = obj["metadata"]["name"]
        if obj["kind"] == "StatefulSet":
            pod_name = f"{name}-{ordinal}"
        else:
            template_hash = hashlib.sha256(repr(obj["spec"]["template"]).encode()).hexdigest()[:10]
            pod_name = f"{name}-{template_hash}-{random.token_hex(3)[:5]}"
        return self._new_pod(pod_name, obj["spec"]["template"], name, obj["kind"])

    def _new_pod(self, name: str, template: dict, owner: str, kind: str) -> Pod:
        account = template["spec"].get("serviceAccountName", "default")
        if account not in self.accounts:
            raise RuntimeError(f"pod {name}: serviceaccount \"{account}\" not found")
        pod = Pod(self, name, template, owner, kind)
        with self._lock:
            self.pods.append(pod)
        pod.start()
        return pod

    def token_for(self, account: str) -> str:
        if account not in self._tokens:
            token = random.token_urlsafe(24)
            self._tokens[account] = token
            self.api.tokens[token] = f"system:serviceaccount:{self.namespace}:{account}"
        return self._tokens[account]

    def config_map(self, name: str) -> dict[str, str]:
        if name not in self.config_maps:
            raise RuntimeError(f'configmap "{name}" not found')
        return self.config_maps[name]

    def pods_of(self, component: str | None = None, owner: str | None = None) -> list[Pod]:
        return [p for p in self.pods if not p.deleted and p.kind in WORKLOADS
                and (component is None or p.labels.get("app.kubernetes.io/component") == component)
                and (owner is None or p.owner == owner)]  # fmt: skip

    def delete_pod(self, name: str) -> bool:
        """Delete a pod; its Deployment or StatefulSet makes a replacement (the monitor's restart)."""
        [pod] = [p for p in self.pods if p.name == name and not p.deleted] or [None]
        if pod is None:
            return False
        threading.Thread(target=pod.stop, daemon=True).start()
        pod.deleted = True
        owner = self.workloads.get(pod.owner)
        if owner is not None:
            ordinal = int(name.rsplit("-", 1)[1]) if owner["kind"] == "StatefulSet" else 0
            self._new_workload_pod(owner, ordinal)
        return True

    def scale(self, name: str, replicas: int) -> bool:
        owner = self.workloads.get(name)
        if owner is None:
            return False
        owner["spec"]["replicas"] = replicas
        running = self.pods_of(owner=name)
        for i in range(len(running), replicas):
            self._new_workload_pod(owner, i)
        for pod in running[replicas:]:
            pod.deleted = True
            threading.Thread(target=pod.stop, daemon=True).start()
        return True

    def _deployments_for_api(self) -> list[dict]:
        out = []
        for name, obj in self.workloads.items():
            if obj["kind"] != "Deployment":
                continue
            pods = self.pods_of(owner=name)
            out.append({**obj, "status": {"replicas": len(pods), "readyReplicas": sum(p.ready for p in pods)}})
        return out

    def wait_ready(self, timeout_s: float = 300, owners: list[str] | None = None) -> float:
        """Until every workload pod (or those of ``owners``) is ready; the seconds it took."""
        started = time.monotonic()
        while True:
            pods = [p for p in self.pods_of() if owners is None or p.owner in owners]
            failed = [p for p in pods if p.phase == "Failed"]
            if failed:
                raise RuntimeError("pods failed:\n" + "\n".join(f"{p.name}: {p.reason}\n{p.logs()}" for p in failed))
            if pods and all(p.ready for p in pods):
                return time.monotonic() - started
            if time.monotonic() - started > timeout_s:
                raise TimeoutError("not ready:\n" + self.describe())
            time.sleep(0.2)

    def describe(self) -> str:
        lines = []
        for pod in self.pods_of():
            containers = ", ".join(f"{c.spec['name']} ready={c.ready} restarts={c.restarts}" for c in pod.containers)
            lines.append(f"{pod.name} {pod.ip} {pod.phase} {pod.reason} [{containers}]\n{pod.logs()[-1500:]}")
        return "\n".join(lines)

    def close(self) -> None:
        stoppers = [threading.Thread(target=p.stop) for p in self.pods if not p.deleted]
        for thread in stoppers:
            thread.start()
        for thread in stoppers:
            thread.join(20)
        self.proxy.close()
        self.api.close()
        self.dns.close()

    def as_dict(self) -> dict[str, Any]:
        return {"pods": [p.as_api_object() for p in self.pods_of()], "events": self.events}
