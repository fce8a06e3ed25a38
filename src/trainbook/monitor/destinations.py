"""Where fired alerts go besides the run log and events.jsonl: a webhook and a command.

Each destination is a sink whose `on_alert` only puts the alert's JSON on the monitors' one kind
of background queue (monitor/background.py); its thread delivers it, so a slow or dead endpoint
never blocks training. A destination that fails is logged once (a warning in the run log) and
training goes on. At close each gets a bounded time to deliver what is queued or
in flight (the last alert of a short run), then its thread stops.
"""

from __future__ import annotations

import json
import logging
import subprocess
import time
import urllib.request

from trainbook.monitor.background import Background
from trainbook.monitor.report import Alert
from trainbook.monitor.sinks import Sink

QUEUE_SIZE = 100  # alerts are rate-limited per rule; a full queue means the destination is stuck


class DeliveryError(Exception):
    pass


class Courier(Background, Sink):
    """Delivers each alert's JSON by `deliver` on the background queue; subclasses define it.
    Every alert is tried (a failure is logged once): the next one may get through."""

    key = ""  # the config key under `alerts.`, named in the warning
    retries = 0
    what = "alerts"

    def __init__(self, logger: logging.Logger):
        self.name = f"alerts.{self.key}"
        self.size = QUEUE_SIZE
        super().__init__(logger)

    def deliver(self, body: bytes) -> None:
        """Send one alert; raise DeliveryError (or OSError) when it did not arrive."""
        raise NotImplementedError

    def on_alert(self, alert: Alert) -> None:
        self.submit(json.dumps(alert.payload()).encode(), f"alert {alert.rule} at step {alert.step}")

    def handle(self, body: bytes) -> None:
        """`deliver`, retried with exponential backoff (0.5 s, 1 s, 2 s, ...), within the drain deadline."""
        for attempt in range(self.retries + 1):
            try:
                self.deliver(body)
                return
            except (DeliveryError, OSError, subprocess.SubprocessError) as e:
                error = e
            delay = 0.5 * 2**attempt
            if attempt == self.retries or self.past_deadline(delay):
                break
            time.sleep(delay)
        self.warn_once(f"delivery failed after {attempt + 1} tries: {error}")


class Webhook(Courier):
    """HTTP POST of the alert's JSON to `url`: `timeout_s` per try, `retries` more tries."""

    key = "webhook_url"

    def __init__(self, url: str, timeout_s: float, retries: int, logger: logging.Logger):
        self.url = url
        self.timeout_s = timeout_s
        self.retries = retries
        self.drain_s = timeout_s  # a last alert in flight may finish one try
        super().__init__(logger)

    def deliver(self, body: bytes) -> None:
        request = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json", "User-Agent": "trainbook"})
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:  # non-2xx raises HTTPError
            response.read()


class AlertCommand(Courier):
    """Runs `argv` (no shell) with the alert's JSON on stdin; a non-zero exit is a failure."""

    key = "command"

    def __init__(self, argv: list[str], timeout_s: float, logger: logging.Logger):
        self.argv = list(argv)
        self.timeout_s = timeout_s
        self.drain_s = timeout_s
        super().__init__(logger)

    def deliver(self, body: bytes) -> None:
        done = subprocess.run(self.argv, input=body, capture_output=True, timeout=self.timeout_s, check=False)
        if done.returncode != 0:
            tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:]
            raise DeliveryError(f"{self.argv[0]} exited with {done.returncode}{': ' + tail[0] if tail else ''}")
