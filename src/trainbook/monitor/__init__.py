"""Observers of training: metrics files, run logs, console progress."""

from trainbook.monitor.logs import close_run_logger, setup_run_logger
from trainbook.monitor.report import EvalReport, StepReport
from trainbook.monitor.sinks import EventLog, LogLines, MetricsFile, Monitor, console_monitor, rewind_metrics

__all__ = [
    "EvalReport", "EventLog", "LogLines", "MetricsFile", "Monitor", "StepReport", "close_run_logger",
    "console_monitor", "rewind_metrics", "setup_run_logger",
]
