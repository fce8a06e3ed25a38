"""The metric sinks the `[monitor]` section switches on: TensorBoard, Prometheus, W&B, MLflow.

`check_sinks` is their part of the one pre-flight (a taken port, a missing optional package: one
line before anything is written); `external_sinks` builds them on rank 0.

The trackers talk to a server (or to W&B's service process), so each runs behind the monitors'
background queue (`Tracked`): the training thread only queues the report. A tracker that fails
(its server slow past the client's own retries, gone, or refusing) is logged once, one line
naming the key and the error, and is switched off for the rest of the run: what it would have
logged next is dropped, since a tracker run with holes in the middle reads as data that is not
there. metrics.jsonl, written before any sink, has every record either way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from trainbook.config import LogConfig, MonitorConfig
from trainbook.monitor.background import Background
from trainbook.monitor.logs import LOGGER_NAME
from trainbook.monitor.prometheus import check_endpoint
from trainbook.monitor.report import RunInfo
from trainbook.monitor.sinks import Sink
from trainbook.monitor.trackers import check_installed


def check_sinks(monitor: MonitorConfig) -> None:
    """Raises a TrainbookError naming the `monitor.*` key when a switched-on sink cannot start."""
    if monitor.prometheus_port:
        check_endpoint(monitor.prometheus_host, monitor.prometheus_port)
    for key in ("wandb", "mlflow"):
        if getattr(monitor, key):
            check_installed(key)


def external_sinks(info: RunInfo, log: LogConfig, monitor: MonitorConfig) -> list[Sink]:
    """Rank 0's sinks, in the order they are built."""
    sinks: list[Sink] = []
    if monitor.tensorboard:
        from trainbook.monitor.tensorboard import TensorBoardSink

        sinks.append(TensorBoardSink(info.paths.tensorboard, log.every_steps, info.max_steps))
    if monitor.prometheus_port:
        from trainbook.monitor.prometheus import PrometheusSink

        sinks.append(PrometheusSink(monitor.prometheus_host, monitor.prometheus_port, info.run_name, info.rank))
    logger = logging.getLogger(LOGGER_NAME)  # the run's logger (monitor/logs.py)
    if monitor.wandb:
        sinks.append(Tracked("monitor.wandb", lambda: _wandb(info, log, monitor, logger),
                             monitor.tracker_close_timeout_s, logger))
    if monitor.mlflow:
        from trainbook.monitor.trackers import MlflowSink

        sinks.append(Tracked("monitor.mlflow", lambda: MlflowSink(
            info.paths, monitor.mlflow_tracking_uri, info.run_name, info.paths.root.name, log.every_steps,
            info.max_steps), monitor.tracker_close_timeout_s, logger))
    return sinks


def _wandb(info: RunInfo, log: LogConfig, monitor: MonitorConfig, logger: logging.Logger) -> Sink:
    """The W&B sink; offline, a resumed run's log line says where each attempt's records are.

    W&B ignores `resume` offline: every attempt writes its own `offline-run-<time>-<id>[-N]`
    directory under the run's one id, marked as a resume, and `wandb sync` uploads those of one id
    in the order they started, into one W&B run. An attempt that was killed (SIGKILL, OOM killer)
    holds only what W&B's service had written to the file before: often nothing.
    """
    from trainbook.monitor.trackers import WandbSink, tracker_run_id

    earlier = sorted(info.paths.wandb.glob(f"offline-run-*-{tracker_run_id(info.paths.root)}*"))
    sink = WandbSink(info.paths, monitor.wandb_project or info.run_name, info.paths.root.name, log.every_steps,
                     info.max_steps)
    if earlier and sink.offline:
        logger.info(f"monitor.wandb: offline, this attempt writes a new W&B run directory beside "
                    f"{len(earlier)} of earlier attempts (the same run id); `wandb sync "
                    f"{info.paths.wandb}` uploads them as one run, a killed attempt's only as far "
                    f"as W&B had written it")
    return sink


class Tracked(Background, Sink):
    """A tracker sink on the background queue: `start` builds it there (W&B's init and MLflow's
    first requests may wait on a server too), then each report is handed to it in order, and its
    own close is the last item. A report is a frozen dataclass: the thread reads what was queued.
    """

    size = 1000  # a logged step is one item: a stuck server holds up to this many, then drops
    what = "records"

    def __init__(self, name: str, start: Callable[[], Sink], drain_s: float, logger: logging.Logger):
        self.name, self.drain_s = name, drain_s
        self._start = start
        self._sink: Sink | None = None
        self._off = False  # failed once: the rest is dropped
        super().__init__(logger)
        self.submit(("start", None), "the start")

    def handle(self, item: tuple[str, object]) -> None:
        method, report = item
        if self._off:
            return
        try:
            if method == "start":
                self._sink = self._start()
            else:
                getattr(self._sink, method)(*([] if report is None else [report]))
        except Exception as e:  # whatever the client raises: no error of a tracker ends training
            self._off = True
            self.warn_once(f"{method} failed, logging to it is off for the rest of the run: "
                           f"{type(e).__name__}: {_one_line(e)}")

    def on_step(self, report) -> None:
        self.submit(("on_step", report), f"step {report.step}")

    def on_eval(self, report) -> None:
        self.submit(("on_eval", report), f"the evaluation at step {report.step}")

    def on_layers(self, report) -> None:
        self.submit(("on_layers", report), f"the layer statistics of step {report.step}")

    def on_alert(self, alert) -> None:
        self.submit(("on_alert", alert), f"alert {alert.rule} at step {alert.step}")

    def close(self) -> None:
        super().close(last=("close", None))


def _one_line(error: Exception) -> str:
    """The first line of an error's text, shortened: a client's error may carry a whole response."""
    text = (str(error).strip().splitlines() or [""])[0]
    return text if len(text) <= 300 else text[:300] + "..."
