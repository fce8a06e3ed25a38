"""Observers of training: metrics files, run logs, console progress, sinks, alerts, reports."""

from trainbook.monitor.build import build_monitors
from trainbook.monitor.logs import close_run_logger, setup_run_logger
from trainbook.monitor.report import Alert, EvalReport, LayerReport, RankSpread, RankTimes, RunInfo, StepReport
from trainbook.monitor.sinks import (
    EventLog, LogLines, MetricsFile, Monitor, Monitors, Sink, console_monitor, rewind_metrics,
)

__all__ = [
    "Alert", "EvalReport", "EventLog", "LayerReport", "LogLines", "MetricsFile", "Monitor", "Monitors",
    "RankSpread", "RankTimes", "RunInfo", "Sink", "StepReport", "build_monitors", "close_run_logger", "console_monitor",
    "rewind_metrics", "setup_run_logger",
]
