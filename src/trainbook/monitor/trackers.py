"""Experiment trackers, optional extras: Weights & Biases (`monitor.wandb`) and MLflow (`monitor.mlflow`).

Both log the same scalars as TensorBoard (monitor/scalars.py) at the logging cadence, every
evaluation and every per-layer statistics step, and both keep one tracker run per trainbook run:
the tracker's run id is derived from the run directory, so a resumed run continues it (offline,
W&B writes one directory per attempt under that id, which `wandb sync` joins: monitor/external.py).
They run behind the background queue there. They are imported only when switched on; the pre-flight (`check_installed`) has already said, in one
line, which pip command installs a missing one.

W&B is offline unless `WANDB_MODE` says otherwise: it writes `<run>/wandb/offline-run-*/`, which
`wandb sync` uploads later, and never opens a connection. MLflow logs to `monitor.mlflow_tracking_uri`,
by default a SQLite store in `<run>/mlruns/` (MLflow's file store is in maintenance mode).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections import Counter
from pathlib import Path

from trainbook.errors import TrainbookError
from trainbook.monitor.report import Alert
from trainbook.monitor.scalars import ScalarSink
from trainbook.runs import RunPaths

EXTRAS = {"wandb": "wandb", "mlflow": "mlflow"}
"""Config key under `monitor.` -> the module it needs (`pip install 'trainbook[<key>]'`)."""


def check_installed(key: str) -> None:
    module = EXTRAS[key]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: a module blocked in sys.modules
        found = False
    if not found:
        raise TrainbookError(f"{module} is not installed: pip install 'trainbook[{key}]'", where=f"monitor.{key}")


def tracker_run_id(run_dir: Path) -> str:
    """The same id for every attempt of one run (its directory), so a resume continues the tracker run."""
    return hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]


class TrackerSink(ScalarSink):
    """The scalars, plus the count of each alert rule's firings (`alerts/<rule>`)."""

    def __init__(self, every_steps: int, max_steps: int):
        super().__init__(every_steps, max_steps)
        self._alerts: Counter[str] = Counter()

    def on_alert(self, alert: Alert) -> None:
        self._alerts[alert.rule] += 1
        self.log({f"alerts/{alert.rule}": float(self._alerts[alert.rule])}, alert.step, alert.time)


class WandbSink(TrackerSink):
    """W&B's run of the trainbook run `paths`, its files in `paths.wandb`."""

    def __init__(self, paths: RunPaths, project: str, name: str, every_steps: int, max_steps: int):
        import wandb

        super().__init__(every_steps, max_steps)
        # Offline unless the user chose otherwise: nothing leaves the machine by default.
        mode = os.environ.get("WANDB_MODE") or "offline"
        self.offline = mode == "offline"
        # W&B makes its own `wandb/` folder (paths.wandb) inside `dir`.
        self._run = wandb.init(
            project=project, name=name, id=tracker_run_id(paths.root), resume="allow", dir=str(paths.wandb.parent),
            mode=mode, settings=wandb.Settings(console="off", silent=True),
        )
        self._step = 0

    def log(self, values: dict[str, float], step: int, time: float) -> None:
        # W&B merges calls with the same step into one row (a train step and its evaluation) and
        # drops a step below the last one: an alert about an earlier step goes in the current row.
        self._step = max(step, self._step)
        self._run.log(values, step=self._step)

    def close(self) -> None:
        """Leave the offline file complete: under torchrun, this process ends with `os._exit` next.

        `finish` returns once the service has taken the run's last records, but the service writes
        them to the file only when it closes the run, which `finish` asks for without waiting; a
        service that sees this process gone first quits without writing them. `teardown` waits
        until the service has closed every run and exited.
        """
        import wandb

        self._run.finish()
        wandb.teardown()


class MlflowSink(TrackerSink):
    """MLflow's run of the trainbook run `paths`; without a tracking URI, its store is `paths.mlflow`."""

    def __init__(self, paths: RunPaths, tracking_uri: str | None, experiment: str, name: str,
                 every_steps: int, max_steps: int):
        from mlflow.tracking import MlflowClient

        super().__init__(every_steps, max_steps)
        artifacts = None  # a tracking server's own choice
        if tracking_uri is None:
            store = paths.mlflow
            store.mkdir(exist_ok=True)
            tracking_uri = f"sqlite:///{(store / 'mlflow.db').resolve()}"
            artifacts = (store / "artifacts").resolve().as_uri()  # else ./mlartifacts, outside the run
        # An explicit client, not mlflow's process-wide active run.
        self._client = client = MlflowClient(tracking_uri=tracking_uri)
        found = client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else client.create_experiment(
            experiment, artifact_location=artifacts)
        run_id = tracker_run_id(paths.root)
        earlier = client.search_runs([experiment_id], filter_string=f"tags.`trainbook.run_id` = '{run_id}'",
                                     max_results=1)
        if earlier:
            self._run_id = earlier[0].info.run_id
            client.update_run(self._run_id, status="RUNNING")
        else:
            self._run_id = client.create_run(experiment_id, run_name=name, tags={
                "trainbook.run_id": run_id, "trainbook.run_dir": str(paths.root.resolve())}).info.run_id

    def log(self, values: dict[str, float], step: int, time: float) -> None:
        from mlflow.entities import Metric

        ms = int(time * 1000)
        self._client.log_batch(self._run_id, metrics=[Metric(k, v, ms, step) for k, v in values.items()])

    def on_alert(self, alert: Alert) -> None:
        super().on_alert(alert)
        self._client.set_tag(self._run_id, f"alert.{alert.rule}", f"step {alert.step}: {alert.message}")

    def close(self) -> None:
        self._client.set_terminated(self._run_id)
