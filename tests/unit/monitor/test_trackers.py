"""W&B and MLflow sinks in one process, fed layer statistics and alerts (which the end-to-end run
does not produce): read back with each tool's own reader. W&B stays offline by default."""

from __future__ import annotations

from tests.unit.monitor.test_metric_sinks import LAYERS, REPORT
from tests.wandb_log import wandb_history
from trainbook.monitor import Alert, EvalReport
from trainbook.monitor.scalars import layer_scalars, step_scalars
from trainbook.monitor.trackers import MlflowSink, WandbSink, tracker_run_id
from trainbook.runs import RunPaths

SPIKE = Alert(run="exp", rank=0, rule="loss_spike", value=9.0, step=7, time=1_700_000_002.0, message="spike")


def feed(sink) -> None:
    sink.on_step(REPORT)  # step 7, every_steps=7: logged
    sink.on_eval(EvalReport(step=7, val_loss=3.5, time=REPORT.time))
    sink.on_layers(LAYERS)
    sink.on_alert(SPIKE)
    sink.on_alert(SPIKE)
    sink.close()


def expected() -> dict[str, float]:
    return {**step_scalars(REPORT), "val/loss": 3.5, **layer_scalars(LAYERS), "alerts/loss_spike": 2.0}


def test_wandb_is_offline_by_default_and_logs_everything(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    # Closed: the log is written.
    feed(WandbSink(RunPaths.of(tmp_path), project="exp", name="run", every_steps=7, max_steps=100))
    [log] = tmp_path.glob(f"wandb/offline-run-*/run-{tracker_run_id(tmp_path)}.wandb")
    history = wandb_history(log)
    assert {tag: values[7] for tag, values in history.items() if not tag.startswith("_")} == expected()


def test_mlflow_logs_to_a_store_in_the_run_and_continues_it(tmp_path):
    from mlflow.tracking import MlflowClient

    feed(MlflowSink(RunPaths.of(tmp_path), None, experiment="exp", name="run", every_steps=7, max_steps=100))
    # A resumed run (same directory) continues the same MLflow run.
    MlflowSink(RunPaths.of(tmp_path), None, experiment="exp", name="run", every_steps=7, max_steps=100).close()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["alert.loss_spike"] == "step 7: spike"
    got = {tag: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, tag)] for tag in run.data.metrics}
    want = {tag: [(7, value)] for tag, value in expected().items()}
    want["alerts/loss_spike"] = [(7, 1.0), (7, 2.0)]
    assert {tag: sorted(v) for tag, v in got.items()} == want


def test_tracker_run_id_follows_the_directory(tmp_path):
    assert tracker_run_id(tmp_path / "a") == tracker_run_id(tmp_path / "x" / ".." / "a")
    assert tracker_run_id(tmp_path / "a") != tracker_run_id(tmp_path / "b")
