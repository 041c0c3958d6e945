"""A local Prometheus that scrapes the suite: ``aiworks up --prometheus`` and the observability tests.

The configuration is rendered from the targets the supervisor knows (service
kind → ``host:port`` of each metrics endpoint), with the job names and the
``service`` label that docker-compose's ``deploy/prometheus/prometheus.yml``
uses, so the committed dashboards and rules work unchanged on either. The
intervals are short (1 s by default): a local run or a test wants a panel to
move within seconds, and a handful of targets on one machine costs little.

The rules come from ``deploy/prometheus/rules``, found next to the source tree
(an editable install or a checkout), or wherever ``AIWORKS_PROMETHEUS_RULES_DIR``
points; an installed wheel carries no ``deploy/`` folder, and Prometheus then
runs without rules rather than not at all.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

from aiworks.core.lifecycle import orphan_proof, terminate

log = logging.getLogger(__name__)

RULES_ENV = "AIWORKS_PROMETHEUS_RULES_DIR"
BINARY_ENV = "AIWORKS_PROMETHEUS_BINARY"
_RULES_IN_REPO = Path("deploy") / "prometheus" / "rules"


class PrometheusNotFound(RuntimeError):
    """The ``prometheus`` binary is not installed (or not where ``AIWORKS_PROMETHEUS_BINARY`` says)."""


def find_rules_dir() -> Path | None:
    """The folder of the suite's rule files, or None when this installation has none.

    Looks at ``AIWORKS_PROMETHEUS_RULES_DIR``, then up from this file (a
    checkout or editable install: ``src/aiworks/supervisor`` is three levels
    below the repository), then up from the working directory.
    """
    configured = os.environ.get(RULES_ENV)
    if configured:
        path = Path(configured).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"{RULES_ENV}={configured} is not a folder")
        return path.resolve()
    for start in (Path(__file__).resolve().parent, Path.cwd().resolve()):
        for folder in (start, *start.parents):
            candidate = folder / _RULES_IN_REPO
            if candidate.is_dir() and any(candidate.glob("*.yml")):
                return candidate
    return None


def find_binary() -> str:
    """Path of the ``prometheus`` executable; :class:`PrometheusNotFound` with the fix when there is none."""
    configured = os.environ.get(BINARY_ENV)
    if configured:
        if not (os.path.isfile(configured) and os.access(configured, os.X_OK)):
            raise PrometheusNotFound(f"{BINARY_ENV}={configured} is not an executable file")
        return configured
    found = shutil.which("prometheus")
    if found is None:
        raise PrometheusNotFound(
            "the prometheus binary is not installed; install the Debian package "
            "(`sudo apt-get install prometheus`, or `scripts/ensure-debian-packages.sh`) "
            f"or point {BINARY_ENV} at one"
        )
    return found


def render_config(
    targets: Mapping[str, Sequence[str]],
    *,
    rules_dir: Path | None = None,
    scrape_interval_s: float = 1.0,
    evaluation_interval_s: float = 1.0,
) -> str:
    """``prometheus.yml`` scraping ``targets`` (service kind → ``["host:port", ...]``) and loading ``rules_dir``.

    Each kind becomes job ``aiworks-<kind>`` with the target label
    ``service: <kind>``; kinds without targets are left out.
    """
    interval = _duration(scrape_interval_s)
    config: dict = {
        "global": {
            "scrape_interval": interval,
            "scrape_timeout": interval,  # may not exceed the interval
            "evaluation_interval": _duration(evaluation_interval_s),
            "external_labels": {"deployment": "local"},
        },
        "rule_files": [str(rules_dir / "*.yml")] if rules_dir is not None else [],
        "scrape_configs": [
            {
                "job_name": f"aiworks-{kind}",
                "static_configs": [{"targets": list(addresses), "labels": {"service": kind}}],
            }
            for kind, addresses in sorted(targets.items())
            if addresses
        ],
    }
    return yaml.safe_dump(config, sort_keys=False)


def _duration(seconds: float) -> str:
    """Prometheus duration text; whole milliseconds, since it accepts no fractions."""
    ms = round(seconds * 1000)
    if ms <= 0:
        raise ValueError(f"an interval must be positive, not {seconds} s")
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


class PrometheusProcess:
    """One Prometheus server for the local suite: ``start()`` waits until it is ready, ``stop()`` ends it.

    Its configuration, TSDB and log live under ``data_dir`` and ``log_path``;
    it binds ``host:port`` only. Like the suite's own children it runs in its
    own session and dies with its parent: with the *thread* that called
    ``start()``, as PR_SET_PDEATHSIG goes, so call it from one that lives as
    long as Prometheus should (the supervisor uses its spawner thread).
    """

    def __init__(
        self,
        targets: Mapping[str, Sequence[str]],
        port: int = 9090,
        data_dir: Path = Path(".aiworks/prometheus"),
        log_path: Path = Path(".aiworks/logs/prometheus.log"),
        *,
        host: str = "127.0.0.1",
        rules_dir: Path | None = None,
        scrape_interval_s: float = 1.0,
        evaluation_interval_s: float = 1.0,
        retention: str = "1d",
    ):
        self.targets = {kind: list(addresses) for kind, addresses in targets.items()}
        self.host = host
        self.port = port
        self.data_dir = Path(data_dir)
        self.log_path = Path(log_path)
        self.rules_dir = rules_dir if rules_dir is not None else find_rules_dir()
        self.scrape_interval_s = scrape_interval_s
        self.evaluation_interval_s = evaluation_interval_s
        self.retention = retention
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """Base URL of the server (its UI, ``/api/v1/...``, ``/-/ready``)."""
        return f"http://{self.host}:{self.port}"

    @property
    def config_path(self) -> Path:
        return self.data_dir / "prometheus.yml"

    def start(self, timeout_s: float = 30.0) -> None:
        """Write the configuration, start the server and wait until ``/-/ready`` answers 200."""
        binary = find_binary()
        if self.rules_dir is None:
            log.warning(
                "no rule files found (a checkout has deploy/prometheus/rules; or set %s): running without rules",
                RULES_ENV,
            )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._write_config()
        argv = [
            binary,
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.data_dir / 'data'}",
            f"--storage.tsdb.retention.time={self.retention}",
            f"--web.listen-address={self.host}:{self.port}",
            "--web.enable-lifecycle",
        ]
        with open(self.log_path, "ab") as logfile:
            self.process = subprocess.Popen(
                orphan_proof(argv),
                stdin=subprocess.DEVNULL,
                stdout=logfile,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        log.info("started prometheus (pid %d) on %s, log %s", self.process.pid, self.url, self.log_path)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"prometheus exited with code {self.process.returncode}; last lines of {self.log_path}:\n"
                    + self._log_tail()
                )
            if self._ready():
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"prometheus was not ready within {timeout_s:.0f} s; see {self.log_path}")

    def set_targets(self, targets: Mapping[str, Sequence[str]]) -> None:
        """Scrape ``targets`` from now on: rewrites the configuration and asks the running server to reload it.

        For replicas started after Prometheus (the monitor scales, a test adds
        one); a target that merely restarts keeps its port and needs nothing.
        """
        self.targets = {kind: list(addresses) for kind, addresses in targets.items()}
        if self.process is None or self.process.poll() is not None:
            return  # start() writes the configuration
        self._write_config()
        request = urllib.request.Request(f"{self.url}/-/reload", method="POST")
        with urllib.request.urlopen(request, timeout=10) as reply:
            if reply.status != 200:
                raise RuntimeError(f"prometheus refused the new configuration ({reply.status}); see {self.log_path}")

    def _write_config(self) -> None:
        self.config_path.write_text(
            render_config(
                self.targets,
                rules_dir=self.rules_dir,
                scrape_interval_s=self.scrape_interval_s,
                evaluation_interval_s=self.evaluation_interval_s,
            )
        )

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (Prometheus flushes its head block), then SIGKILL after ``timeout_s``."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        terminate(process, "prometheus", timeout_s)
        log.info("stopped prometheus")

    def __enter__(self) -> PrometheusProcess:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
