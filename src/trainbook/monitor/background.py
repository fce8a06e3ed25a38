"""The one background queue of the monitors: what talks to the network runs off the training thread.

An alert destination (a webhook, a command) and an experiment tracker (W&B, MLflow) are each a
`Background`: the training thread only puts an item on a bounded queue and goes on; one thread
per owner handles the items in order. A full queue drops the new item and counts it (one warning
at the first drop, the count at close) instead of blocking a step. At close the thread gets a
bounded time to handle what is queued or in flight, then it is left to die with the process (a
daemon): a stuck endpoint delays the end of a run by at most that time.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

_STOP = object()  # the last item: the thread ends after it


class Background:
    """A bounded queue and the thread that hands each item to `handle`; subclasses define it.

    `name` is the config key warnings name (`alerts.webhook_url`, `monitor.mlflow`).
    """

    name = ""
    size = 100
    drain_s = 5.0
    what = "items"  # what an item is, in warnings

    def __init__(self, logger: logging.Logger):
        self.logger = logger
        self._queue: queue.Queue = queue.Queue(self.size)
        self._deadline: float | None = None  # set at close: the monotonic time handling gives up
        self._warned = False
        self._dropped = 0
        self._thread = threading.Thread(target=self._run, name=f"trainbook-{self.name}", daemon=True)
        self._thread.start()

    def handle(self, item) -> None:
        """Handle one item on the background thread."""
        raise NotImplementedError

    def submit(self, item, label: str) -> None:
        """Queue `item` without waiting; when the queue is full it is dropped (`label` says which)."""
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._dropped += 1
            if self._dropped == 1:
                self.logger.warning(f"{self.name}: {self.size} {self.what} are waiting; {label} dropped, "
                                    f"and every one after it while the queue is full (counted at the end)")

    def _run(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            self.handle(item)

    def past_deadline(self, delay: float = 0.0) -> bool:
        """Whether waiting `delay` more seconds would pass the close's deadline."""
        return self._deadline is not None and time.monotonic() + delay > self._deadline

    def warn_once(self, text: str) -> None:
        """One warning line for the owner's whole run: a dead endpoint fails every item after the first."""
        if not self._warned:
            self._warned = True
            self.logger.warning(f"{self.name}: {text}; training goes on, further failures are not logged")

    def close(self, last=None) -> None:
        """Queue `last` (when given: the owner's own closing item) and the stop, waiting for room
        within the deadline, then wait for the thread until the deadline."""
        self._deadline = time.monotonic() + self.drain_s
        for item in ([] if last is None else [last]) + [_STOP]:
            try:
                self._queue.put(item, timeout=max(0.0, self._deadline - time.monotonic()))
            except queue.Full:
                break
        self._thread.join(max(0.0, self._deadline - time.monotonic()))
        if self._dropped:
            self.logger.warning(f"{self.name}: {self._dropped} {self.what} dropped because the queue was full")
        if self._thread.is_alive():
            # Still in flight: the thread is a daemon and dies with the process.
            self.warn_once(f"{self.what} still unhandled after {self.drain_s:g} s at the end of the run "
                           f"({self._queue.qsize()} queued)")
