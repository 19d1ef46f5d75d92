"""Real `aml-app worker` processes, started and watched from the outside.

The demo, the integration tests and the benchmarks all run the service as a user would: separate
worker processes talking to a broker. They share this one way of doing it, so a worker in a test is
configured, started, observed (`/watermarks.json`) and stopped exactly like a worker in the demo.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import aiohttp

from aml_app import dependency_services as registry
from aml_app.harness.child_process import AmlAppProcess
from aml_app.settings import Settings
from aml_app.tokens import QUERY, bearer


def settings_env(settings: Settings) -> dict[str, str]:
    """The settings that say which broker, topics and groups a worker uses, as its environment.

    Spelled out so that a worker serves the Settings it was given, not whatever the caller's
    environment says; everything else is inherited.
    """
    return {
        "KAFKA_BOOTSTRAP_SERVERS": ",".join(settings.kafka.bootstrap_servers),
        "AML_SERVICE": settings.service,
        "AML_APP_ID": settings.app_id,
        "AML_DEPENDS_ON": ",".join(settings.depends_on),
        "AML_DERIVED_DEPENDENCIES": ",".join(
            f"{group}:{topic}:{stage}" for group, (topic, stage) in settings.derived_dependencies.items()
        ),
        # Which of the groups is B's and which C's: the detectors check a derived group's answers by it.
        **{s.group_env: s.group(settings) for s in registry.SERVICES.values()},
        "AML_PAYMENTS_TOPIC": settings.kafka.payments_topic,
        "AML_DECISIONS_TOPIC": settings.kafka.decisions_topic,
        "AML_ALERTS_TOPIC": settings.kafka.alerts_topic,
        "AML_DLQ_TOPIC": settings.kafka.dlq_topic,
        "AML_REVIEW_TOPIC": settings.kafka.review_topic,
        "AML_PARTITIONS": str(settings.kafka.partitions),
        "AML_API_TOKEN": settings.dependencies.api_token,
        "AML_WEB_TOKEN": settings.web.token,
    }


class WorkerProcess(AmlAppProcess):
    """One `aml-app worker` process with its own web port, id, data directory and log file.

    It runs in a process group of its own: a Ctrl-C in the caller's terminal does not reach it, and
    `stop`/`kill` reach it and anything it started.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        port: int,
        worker_id: str,
        data_dir: Path,
        log_path: Path,
        cwd: Path | None = None,
        executable: str | None = None,
        **env: str,
    ) -> None:
        """`env` overrides any of the worker's environment variables (AML_GATE="off", ...); `executable`
        is the `aml-app` to run (default: the one beside this interpreter, see `aml_app_executable`)."""
        environment = {
            **os.environ,
            **settings_env(settings),
            "AML_WEB_PORT": str(port),
            "AML_DATA_DIR": str(data_dir),
            "AML_WORKER_ID": worker_id,
            **env,
        }
        super().__init__(["worker", "-l", "info"], environment, log_path, cwd, executable=executable)
        self.port = port
        self.worker_id = worker_id
        #: What a request to the worker's web server carries: its token, when it wants one (AML_WEB_TOKEN).
        self._web_token = environment.get("AML_WEB_TOKEN", "")
        self.headers = bearer(self._web_token)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def page_url(self) -> str:
        """The operator page's address to open in a browser: with the token, when there is one."""
        page = f"{self.url}/watermarks/"
        return f"{page}?{urlencode({QUERY: self._web_token})}" if self._web_token else page

    @property
    def state_url(self) -> str:
        return f"{self.url}/watermarks.json"

    async def state(self, timeout: float = 2) -> dict[str, Any] | None:
        """The worker's /watermarks.json, or None while it does not answer."""
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.get(
                    self.state_url, headers=self.headers, timeout=aiohttp.ClientTimeout(timeout)
                ) as r,
            ):
                return await r.json() if r.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    def stop(self, grace: float = 30) -> bool:
        """SIGTERM the process group, then SIGKILL it after `grace` seconds; False if it had to be killed."""
        if not self.alive():
            return True
        self.signal_group(signal.SIGTERM)
        if self.wait(grace):
            return True
        self.kill()
        return False
