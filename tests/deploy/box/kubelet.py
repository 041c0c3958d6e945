"""The box's kubelet: one pod as local processes, with exactly the env, args and files its spec gives.

Per pod: a network namespace (``network.py``), a folder holding each
volume (ConfigMaps and Secrets written out, emptyDirs, PVCs, the
ServiceAccount token), and one mount namespace per container in which those
folders are bind-mounted at the spec's mount paths (read-only where asked),
plus the pod's ``/etc/hosts`` and ``/etc/resolv.conf`` (the box's cluster
DNS, ``dns.py``). Init containers run first, in order, each to
completion; then the containers start, restart with back-off when they
exit (restartPolicy Always), and are probed as the kubelet probes them
(startup, then readiness with its failureThreshold; exec probes run inside
the container, with at least 15 s to answer on this loaded machine).

Not modelled: users and groups (processes run as the box's user), resource
limits, liveness restarts, image filesystems (a container sees this
machine's files, with its volumes mounted over them).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import socket
import ssl
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import images

if TYPE_CHECKING:
    from .cluster import Box

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined names are replaced, others kept; $$ escapes."""
    return _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), value.replace("$$(", "\0")).replace("\0", "$(")


@dataclass
class Container:
    spec: dict
    log: Path
    process: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)
    ready: bool = False
    started: bool = False
    restarts: int = 0
    exit_code: int | None = None


class Pod:
    """One pod of a workload, Job or `helm test`."""

    def __init__(self, box: Box, name: str, template: dict, owner: str, kind: str):
        self.box = box
        self.name = name
        self.owner = owner  # Deployment/StatefulSet/Job name
        self.kind = kind
        self.metadata = {**template.get("metadata", {}), "name": name, "namespace": box.namespace}
        self.spec = template["spec"]
        self.labels: dict[str, str] = dict(self.metadata.get("labels", {}))
        self.root = box.workdir / "pods" / name
        self.root.mkdir(parents=True)
        self.network = box.node.add_pod()
        self.phase = "Pending"
        self.reason = ""
        self.deleted = False
        self.init = [Container(c, self.root / f"{c['name']}.init.log") for c in self.spec.get("initContainers", [])]
        self.containers = [Container(c, self.root / f"{c['name']}.log") for c in self.spec["containers"]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"pod-{name}", daemon=True)

    # ---- life ------------------------------------------------------------------------------

    @property
    def ip(self) -> str:
        return self.network.address

    @property
    def ready(self) -> bool:
        return self.phase == "Running" and all(c.ready for c in self.containers)

    def start(self) -> None:
        self._thread.start()

    def wait_done(self, timeout_s: float) -> int | None:
        """For run-to-completion pods: the main container's exit code, None on timeout."""
        self._thread.join(timeout_s)
        return None if self._thread.is_alive() else self.containers[0].exit_code

    def stop(self) -> None:
        self.deleted = True
        self._stop.set()
        for container in self.init + self.containers:
            _terminate(container.process)
        self._thread.join(15)
        self.network.close()

    def kill(self) -> None:
        """SIGKILL every container, as a node failure would (the pod stays, its containers restart)."""
        for container in self.containers:
            if container.process and container.process.poll() is None:
                container.process.kill()

    def _run(self) -> None:
        try:
            volumes = self._volumes()
            for container in self.init:
                self.reason = f"Init:{container.spec['name']}"
                code = self._run_to_end(container, volumes)
                if code != 0:
                    self.phase, self.reason = "Failed", f"Init:Error ({container.spec['name']} exited {code})"
                    return
            self.phase, self.reason = "Running", ""
            to_completion = self.spec.get("restartPolicy", "Always") != "Always"
            if to_completion:
                code = self._run_to_end(self.containers[0], volumes)
                self.phase = "Succeeded" if code == 0 else "Failed"
                return
            for container in self.containers:
                self._launch(container, volumes)
                threading.Thread(target=self._probe_loop, args=(container,), daemon=True).start()
            self._supervise(volumes)
        except Exception as exc:  # the pod fails; the box reports why
            self.phase, self.reason = "Failed", f"{type(exc).__name__}: {exc}"

    def _supervise(self, volumes: dict[str, Path]) -> None:
        while not self._stop.wait(0.2):
            for container in self.containers:
                process = container.process
                if process is not None and process.poll() is not None:
                    container.exit_code, container.ready, container.started = process.returncode, False, False
                    container.restarts += 1
                    backoff = min(10 * 2 ** (container.restarts - 1), 300)
                    if self._stop.wait(min(backoff, 10)):  # shortened back-off: the box's tests are short
                        return
                    self._launch(container, volumes)

    def _run_to_end(self, container: Container, volumes: dict[str, Path]) -> int:
        self._launch(container, volumes)
        while container.process.poll() is None:
            if self._stop.wait(0.1):
                _terminate(container.process)
        container.exit_code = container.process.returncode
        return container.exit_code

    # ---- volumes, env, processes -----------------------------------------------------------

    def _volumes(self) -> dict[str, Path]:
        """Each volume's folder, filled as the kubelet fills it (waits for Secrets that do not exist yet)."""
        out: dict[str, Path] = {}
        for volume in self.spec.get("volumes", []):
            folder = self.root / "volumes" / volume["name"]
            folder.mkdir(parents=True)
            if "emptyDir" in volume:
                pass
            elif "configMap" in volume:
                data = self.box.config_map(volume["configMap"]["name"])
                self._write_items(folder, data, volume["configMap"].get("items"))
            elif "secret" in volume:
                data = self._wait_secret(volume["secret"]["secretName"])
                self._write_items(folder, data, volume["secret"].get("items"))
            elif "persistentVolumeClaim" in volume:
                folder.rmdir()
                folder = self.box.claim(volume["persistentVolumeClaim"]["claimName"])
            else:
                raise NotImplementedError(f"volume kind {sorted(volume)} is not modelled by the box")
            out[volume["name"]] = folder
        if self.spec.get("automountServiceAccountToken", True):
            folder = self.root / "volumes" / "kube-api-access"
            folder.mkdir(parents=True)
            account = self.spec.get("serviceAccountName", "default")
            (folder / "token").write_text(self.box.token_for(account))
            (folder / "ca.crt").write_bytes(self.box.api_ca.read_bytes())
            (folder / "namespace").write_text(self.box.namespace)
            out["kube-api-access"] = folder
        return out

    def _wait_secret(self, name: str, timeout_s: float = 60.0) -> dict[str, bytes]:
        deadline = time.monotonic() + timeout_s
        while (data := self.box.api.secret_data(self.box.namespace, name)) is None:
            self.reason = f"ContainerCreating: secret {name} not found"
            if time.monotonic() > deadline or self._stop.is_set():
                raise RuntimeError(f'secret "{name}" not found')
            time.sleep(0.2)
        return data

    @staticmethod
    def _write_items(folder: Path, data: dict[str, bytes | str], items: list[dict] | None) -> None:
        for item in items or [{"key": k, "path": k} for k in data]:
            value = data[item["key"]]
            target = folder / item["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(value.encode() if isinstance(value, str) else value)

    def _env(self, spec: dict, image: images.Image) -> dict[str, str]:
        env = images.host_path_env(image.env)
        env["HOSTNAME"] = self.name
        env.update(self.box.kubernetes_env())
        if self.spec.get("enableServiceLinks", True):
            env.update(self.box.service_links())
        for source in spec.get("envFrom", []):
            if "secretRef" in source:
                data = self._wait_secret(source["secretRef"]["name"])
            else:
                data = self.box.config_map(source["configMapRef"]["name"])
            env.update({source.get("prefix", "") + k: v.decode() if isinstance(v, bytes) else v for k, v in data.items()})
        for entry in spec.get("env", []):
            if "value" in entry:
                env[entry["name"]] = expand(str(entry["value"]), env)
            elif "valueFrom" in entry:
                env[entry["name"]] = self._value_from(entry["valueFrom"])
            else:
                env[entry["name"]] = ""
        return env

    def _value_from(self, source: dict) -> str:
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            fields = {"metadata.name": self.name, "metadata.namespace": self.box.namespace, "status.podIP": self.ip,
                      "spec.serviceAccountName": self.spec.get("serviceAccountName", "default")}  # fmt: skip
            if m := re.fullmatch(r"metadata\.labels\['(.+)'\]", path):
                return self.labels.get(m.group(1), "")
            return fields[path]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            return self._wait_secret(ref["name"])[ref["key"]].decode()
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            return self.box.config_map(ref["name"])[ref["key"]]
        raise NotImplementedError(f"valueFrom {sorted(source)}")

    def _mounts(self, spec: dict, volumes: dict[str, Path]) -> list[tuple[Path, str, bool]]:
        mounts = []
        for mount in spec.get("volumeMounts", []):
            source = volumes[mount["name"]]
            if mount.get("subPath"):
                source = source / mount["subPath"]
            mounts.append((source, mount["mountPath"], bool(mount.get("readOnly"))))
        if "kube-api-access" in volumes:
            mounts.append((volumes["kube-api-access"], SA_DIR, True))
        hosts, resolv = self.root / "hosts", self.root / "resolv.conf"
        self.box.write_hosts(self, hosts, resolv)
        mounts += [(hosts, "/etc/hosts", True), (resolv, "/etc/resolv.conf", True)]
        # Parents first, /tmp last: later sources may live under this machine's /tmp.
        return sorted(mounts, key=lambda m: (m[1] == "/tmp", m[1].count("/"), m[1]))

    def _launch(self, container: Container, volumes: dict[str, Path]) -> None:
        spec = container.spec
        image = images.image(spec["image"])
        env = self._env(spec, image)
        command = [expand(a, env) for a in (spec.get("command") or image.entrypoint)]
        args = [expand(a, env) for a in (spec["args"] if "args" in spec else ([] if spec.get("command") else image.cmd))]
        argv = [images.executable(command[0]), *command[1:], *args]
        workdir = self.root / "workdir" / spec["name"]
        workdir.mkdir(parents=True, exist_ok=True)
        # The image's WORKDIR, writable, as its layer would be.
        mounts = [(workdir, image.workdir, False), *self._mounts(spec, volumes)] if image.workdir != "/" else self._mounts(spec, volumes)
        mounts.sort(key=lambda m: (m[1] == "/tmp", m[1].count("/"), m[1]))
        lines = ["set -e"]
        done: list[tuple[Path, str]] = []
        for source, target, read_only in mounts:
            # A mount point inside an earlier mount is made in that mount's source; others on this machine.
            outer = max((d for d in done if target.startswith(d[1].rstrip("/") + "/")), key=lambda d: len(d[1]), default=None)
            point = outer[0] / target[len(outer[1]) :].lstrip("/") if outer else Path(target)
            if source.is_dir():
                point.mkdir(parents=True, exist_ok=True)
            else:
                if not source.exists():
                    source.parent.mkdir(parents=True, exist_ok=True)
                    source.touch()
                if not point.exists():
                    point.parent.mkdir(parents=True, exist_ok=True)
                    point.touch()
            lines.append(f"mount --bind {shlex.quote(str(source))} {shlex.quote(target)}")
            if read_only:
                lines.append(f"mount -o remount,bind,ro {shlex.quote(target)}")
            done.append((source, target))
        lines.append(f"cd {shlex.quote(image.workdir)}")
        lines.append('exec "$@"')
        launcher = ["nsenter", f"--net={self.network.netns}", "unshare", "--mount", "--propagation", "private",
                    "/bin/sh", "-c", "\n".join(lines), "sh", *argv]  # fmt: skip
        container.env = env
        with container.log.open("ab") as log:
            log.write(f"--- {time.strftime('%H:%M:%S')} {' '.join(argv)}\n".encode())
            log.flush()
            container.process = subprocess.Popen(launcher, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                 stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip

    # ---- probes ----------------------------------------------------------------------------

    def _probe_loop(self, container: Container) -> None:
        """Startup, then readiness, as the kubelet probes: ready on a success, not ready only after
        ``failureThreshold`` failures in a row (a restarted container starts over, not ready)."""
        spec = container.spec
        failures, probed = 0, None
        while not self._stop.is_set():
            process = container.process
            if process is None or process.poll() is not None:
                time.sleep(0.2)
                continue
            if process is not probed:
                failures, probed = 0, process
            probe = spec.get("startupProbe") if not container.started else spec.get("readinessProbe")
            if probe is None:
                container.started = True
                if spec.get("readinessProbe") is None:
                    container.ready = True
                    time.sleep(0.5)
                continue
            ok = self._probe(container, probe)
            if not container.started:
                container.started = ok
                if ok:
                    continue  # readiness is probed at once after start-up succeeds
            else:
                failures = 0 if ok else failures + 1
                if ok or failures >= int(probe.get("failureThreshold", 3)):
                    container.ready = ok
            self._stop.wait(float(probe.get("periodSeconds", 10)))

    def _probe(self, container: Container, probe: dict) -> bool:
        timeout = float(probe.get("timeoutSeconds", 1))
        try:
            if "httpGet" in probe:
                get = probe["httpGet"]
                scheme = get.get("scheme", "HTTP").lower()
                context = ssl._create_unverified_context() if scheme == "https" else None  # the kubelet does not verify
                url = f"{scheme}://{self.ip}:{self._port(container, get['port'])}{get.get('path', '/')}"
                with urllib.request.urlopen(url, timeout=timeout, context=context) as reply:
                    return 200 <= reply.status < 400
            if "tcpSocket" in probe:
                with socket.create_connection((self.ip, self._port(container, probe["tcpSocket"]["port"])), timeout):
                    return True
            if "grpc" in probe:
                import grpc
                from grpc_health.v1 import health_pb2, health_pb2_grpc

                with grpc.insecure_channel(f"{self.ip}:{probe['grpc']['port']}") as channel:
                    reply = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", "")), timeout=timeout
                    )
                    return reply.status == health_pb2.HealthCheckResponse.SERVING
            if "exec" in probe:
                # Generous: an exec probe starts a Python CLI, which on the shared 2-core machine under load
                # can take longer than the chart's timeoutSeconds (sized for a real node).
                return self.exec(container, probe["exec"]["command"], timeout=max(timeout, 15)).returncode == 0
        except Exception:
            return False
        raise NotImplementedError(f"probe {sorted(probe)}")

    def _port(self, container: Container, port: int | str) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        return next(p["containerPort"] for p in container.spec.get("ports", []) if p["name"] == port)

    def exec(self, container: Container, command: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
        """Run a command inside a running container (its network and mount namespaces, its env): kubectl exec."""
        argv = [images.executable(command[0]), *command[1:]]
        return subprocess.run(["nsenter", f"--target={container.process.pid}", "--net", "--mount", *argv],
                              env=container.env, capture_output=True, text=True, timeout=timeout)  # fmt: skip

    # ---- the API's view --------------------------------------------------------------------

    def as_api_object(self) -> dict[str, Any]:
        ready = "True" if self.ready else "False"
        return {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {**self.metadata, "labels": self.labels, "uid": self.name},
            "spec": {"containers": [{"name": c.spec["name"], "image": c.spec["image"]} for c in self.containers],
                     "serviceAccountName": self.spec.get("serviceAccountName", "default")},
            "status": {
                "phase": self.phase, "podIP": self.ip, "reason": self.reason or None,
                "conditions": [{"type": "Ready", "status": ready}],
                "containerStatuses": [
                    {"name": c.spec["name"], "ready": c.ready, "restartCount": c.restarts, "image": c.spec["image"],
                     "imageID": "", "state": {"running": {}} if c.process and c.process.poll() is None else
                     {"terminated": {"exitCode": c.exit_code or 0}}}
                    for c in self.containers
                ],
            },
        }  # fmt: skip

    def logs(self) -> str:
        return "\n".join(f"== {c.log.name}\n{c.log.read_text()[-4000:]}" for c in self.init + self.containers if c.log.exists())


def _terminate(process: subprocess.Popen | None) -> None:
    if process is None or process.poll() is not None:
        return
    try:
        os.killpg(process.pid, 15)
        process.wait(10)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        try:
            os.killpg(process.pid, 9)
        except ProcessLookupError:
            pass
        process.wait()


def decode_secret(data: dict[str, str]) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in data.items()}


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=1, default=str)
