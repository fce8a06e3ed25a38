"""The metric sinks the `[monitor]` section switches on: TensorBoard, Prometheus, W&B, MLflow.

`check_sinks` is their part of the one pre-flight (a taken port, a missing optional package: one
line before anything is written); `external_sinks` builds them on rank 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainbook.config import LogConfig, MonitorConfig
from trainbook.monitor.prometheus import check_endpoint
from trainbook.monitor.sinks import Sink
from trainbook.monitor.trackers import check_installed

if TYPE_CHECKING:
    from trainbook.monitor.build import RunInfo


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

        sinks.append(TensorBoardSink(info.run_dir / "tb", log.every_steps, info.max_steps))
    if monitor.prometheus_port:
        from trainbook.monitor.prometheus import PrometheusSink

        sinks.append(PrometheusSink(monitor.prometheus_host, monitor.prometheus_port, info.run_name, info.rank))
    if monitor.wandb:
        from trainbook.monitor.trackers import WandbSink

        sinks.append(WandbSink(info.run_dir, monitor.wandb_project or info.run_name, info.run_dir.name,
                               log.every_steps, info.max_steps))
    if monitor.mlflow:
        from trainbook.monitor.trackers import MlflowSink

        sinks.append(MlflowSink(info.run_dir, monitor.mlflow_tracking_uri, info.run_name, info.run_dir.name,
                                log.every_steps, info.max_steps))
    return sinks
