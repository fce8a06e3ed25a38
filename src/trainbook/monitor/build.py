"""The monitors of one run, from the recipe's `[log]`, `[monitor]` and `[alerts]` sections.

Rank 0 writes the run's records (metrics.jsonl, events.jsonl, layers.jsonl, TensorBoard,
Prometheus, W&B/MLflow), fires alerts and drives the console; every rank keeps its own log file.
"""

from __future__ import annotations

import logging

from trainbook.config import AlertsConfig, LogConfig, MonitorConfig
from trainbook.monitor.alerts import add_alerts
from trainbook.monitor.external import external_sinks
from trainbook.monitor.report import RunInfo
from trainbook.monitor.sinks import (
    AlertEvents, EventLog, ExpertsFile, LayersFile, LogLines, MetricsFile, Monitors, console_monitor,
)


def build_monitors(info: RunInfo, log: LogConfig, monitor: MonitorConfig, alerts: AlertsConfig,
                   logger: logging.Logger, events: EventLog | None) -> Monitors:
    """`events` is rank 0's events.jsonl (None on the other ranks)."""
    if events is None:
        return Monitors([LogLines(logger, log.every_steps, info.max_steps)])
    monitors = Monitors([
        MetricsFile(info.paths.metrics, log.every_steps, info.max_steps),
        LogLines(logger, log.every_steps, info.max_steps),
        AlertEvents(events),
        ExpertsFile(info.paths.experts),
    ])
    if monitor.layer_stats_every > 0:
        monitors.add(LayersFile(info.paths.layers))
    monitors.add(console_monitor(log.progress, log.every_steps, info.max_steps))
    for sink in external_sinks(info, log, monitor):
        monitors.add(sink)
    add_alerts(monitors, info, alerts, logger)  # keep last: closed first, the rules stop before any sink
    return monitors
