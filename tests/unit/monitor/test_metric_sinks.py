"""The metric sinks in one process, fed reports the trainer does not make yet (per-rank spread,
layer statistics, alerts): a real HTTP endpoint scraped, real event files read back, and the
shipped Grafana dashboard checked against the metric names the sink exports."""

from __future__ import annotations

import json
import re
import socket
import urllib.request
from pathlib import Path

import pytest

from trainbook.errors import TrainbookError
from trainbook.monitor import Alert, EvalReport, LayerReport, RankSpread, StepReport
from trainbook.monitor.prometheus import METRICS, PrometheusSink, check_endpoint, exported_names
from trainbook.monitor.scalars import step_scalars
from trainbook.monitor.sinks import Monitors, Sink
from trainbook.monitor.tensorboard import TensorBoardSink

LAUNCH = Path(__file__).resolve().parents[3] / "launch"

REPORT = StepReport(
    step=7, tokens=7 * 256, loss=3.25, lr=2.5e-4, grad_norm=0.75, tokens_per_s=1234.5, step_time_s=0.2,
    phases={"data": 0.01, "forward": 0.06, "backward": 0.1, "optimizer": 0.03}, mem_peak_bytes=123456789,
    loss_scale=1024.0, skipped_steps=2, time=1_700_000_000.5, mfu=0.41, data_wait_share=0.05,
    data_mix={"plays": {"target": 1.0, "actual": 1.0}},
    ranks=RankSpread(step_time_s=[0.2, 0.25], data_wait_s=[0.01, 0.04], mem_peak_bytes=[123456789, 99]),
)
LAYERS = LayerReport(
    step=7, time=1_700_000_001.0,
    blocks={f"layers.{i}": {"grad_norm": 0.1 * (i + 1), "param_norm": 2.0 + i, "update_ratio": 1e-3 * (i + 1),
                            "act_mean": 0.0, "act_std": 1.0 + i, "act_max_abs": 4.0, "act_zero_frac": 0.0}
            for i in range(3)} | {"output": {"grad_norm": 0.5, "param_norm": 9.0, "update_ratio": 2e-3}},
    groups={"decay": {"grad_norm": 0.9, "param_norm": 12.0, "update_ratio": 1e-3}},
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_prometheus_sink_serves_every_report_until_closed():
    port = free_port()
    sink = PrometheusSink("127.0.0.1", port, run="exp", rank=0)
    try:
        sink.on_step(REPORT)
        sink.on_eval(EvalReport(step=7, val_loss=3.5, time=0.0))
        for _ in range(2):
            sink.on_alert(Alert(run="exp", rank=0, rule="loss_spike", value=9.0, step=7, time=0.0, message="spike"))
        sink.on_alert(Alert(run="exp", rank=0, rule="stall", value=None, step=7, time=0.0, message="stalled"))
        got = scrape(port)
    finally:
        sink.close()
    own = (("rank", "0"), ("run", "exp"))
    assert got[("trainbook_step", own)] == 7
    assert got[("trainbook_loss", own)] == 3.25 and got[("trainbook_val_loss", own)] == 3.5
    assert got[("trainbook_mfu", own)] == 0.41 and got[("trainbook_loss_scale", own)] == 1024.0
    assert got[("trainbook_skipped_steps", own)] == 2
    assert got[("trainbook_last_step_timestamp_seconds", own)] == REPORT.time
    assert got[("trainbook_phase_seconds", (("phase", "backward"), *own))] == 0.1
    assert got[("trainbook_alerts_total", (("rank", "0"), ("rule", "loss_spike"), ("run", "exp")))] == 2
    assert got[("trainbook_alerts_total", (("rank", "0"), ("rule", "stall"), ("run", "exp")))] == 1
    for rank in (0, 1):  # the spread: labelled by the rank whose value it is
        labels = (("rank", str(rank)), ("run", "exp"))
        assert got[("trainbook_rank_step_time_seconds", labels)] == REPORT.ranks.step_time_s[rank]
        assert got[("trainbook_rank_data_wait_seconds", labels)] == REPORT.ranks.data_wait_s[rank]
        assert got[("trainbook_rank_memory_peak_bytes", labels)] == REPORT.ranks.mem_peak_bytes[rank]
    assert {name for name, _ in got} <= exported_names()
    # Closed: the port is free again (a next run may take it), and nothing answers there.
    check_endpoint("127.0.0.1", port)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)


def test_prometheus_sinks_do_not_share_a_registry():
    """Two sinks in one process (two runs in a notebook): each has its own metrics."""
    a, b = PrometheusSink("127.0.0.1", free_port(), "a", 0), PrometheusSink("127.0.0.1", free_port(), "b", 0)
    try:
        a.on_step(REPORT)
        assert a.registry is not b.registry
        assert b.registry.get_sample_value("trainbook_step", {"run": "a", "rank": "0"}) is None
        assert a.registry.get_sample_value("trainbook_step", {"run": "a", "rank": "0"}) == 7
    finally:
        a.close(), b.close()


def test_a_skipped_steps_infinite_grad_norm_is_not_exported():
    port = free_port()
    sink = PrometheusSink("127.0.0.1", port, run="exp", rank=0)
    try:
        sink.on_step(StepReport(step=1, tokens=1, loss=1.0, lr=1.0, grad_norm=float("inf"), tokens_per_s=1.0,
                                step_time_s=1.0))
        assert ("trainbook_grad_norm", (("rank", "0"), ("run", "exp"))) not in scrape(port)
    finally:
        sink.close()
    assert "train/grad_norm" not in step_scalars(StepReport(1, 1, 1.0, 1.0, float("nan"), 1.0, 1.0))


def test_check_endpoint_names_the_key():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(TrainbookError) as e:
            check_endpoint("127.0.0.1", port)
    assert e.value.where == "monitor.prometheus_port"
    with pytest.raises(TrainbookError) as e:
        check_endpoint("192.0.2.1", 9400)  # TEST-NET-1: never this machine's
    assert e.value.where == "monitor.prometheus_host"


def test_tensorboard_layer_histograms_and_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    sink = TensorBoardSink(tmp_path, every_steps=10, max_steps=100)
    sink.on_step(REPORT)  # step 7: not at the logging cadence, not written
    sink.on_layers(LAYERS)
    sink.on_alert(Alert(run="exp", rank=0, rule="loss_spike", value=9.0, step=7, time=0.0, message="spike at 7"))
    sink.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0, "histograms": 0})
    acc.Reload()
    assert "train/loss" not in acc.Tags()["tensors"]
    # One histogram per statistic, over the blocks that have it (output has no activations).
    assert set(acc.Tags()["histograms"]) == {f"layers/{s}" for s in LAYERS.blocks["layers.0"]}
    [grad] = acc.Histograms("layers/grad_norm")
    assert grad.step == 7 and grad.histogram_value.num == 4
    assert grad.histogram_value.min == pytest.approx(0.1) and grad.histogram_value.max == 0.5
    assert acc.Histograms("layers/act_std")[0].histogram_value.num == 3
    scalar = {tag: make_ndarray(acc.Tensors(tag)[0].tensor_proto).item() for tag in acc.Tags()["tensors"]
              if not tag.startswith("alerts/")}
    assert scalar["layers/layers.2/update_ratio"] == LAYERS.blocks["layers.2"]["update_ratio"]
    assert scalar["groups/decay/param_norm"] == 12.0
    assert len(scalar) == 3 * 7 + 3 + 3
    assert "alerts/loss_spike/text_summary" in acc.Tags()["tensors"]


def test_grafana_dashboard_uses_only_exported_metrics():
    dashboard = json.loads((LAUNCH / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v.get("definition")]
    used = {name for expr in exprs for name in re.findall(r"\btrainbook_[a-z_]+", expr)}
    assert used and used <= exported_names(), used - exported_names()
    # Every metric the sink exports has a panel (a counter through its _total series).
    assert {n if METRICS[n][0] == "gauge" else f"{n}_total" for n in METRICS} <= used


def test_prometheus_scrape_config_parses():
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((LAUNCH / "prometheus.yml").read_text())
    [job] = config["scrape_configs"]
    assert job["job_name"] == "trainbook" and job["static_configs"][0]["targets"] == ["127.0.0.1:9400"]


def test_monitors_close_every_monitor_when_one_fails():
    closed = []

    class Closing(Sink):
        def __init__(self, name: str, fails: bool = False):
            self.name, self.fails = name, fails

        def close(self) -> None:
            closed.append(self.name)
            if self.fails:
                raise OSError(f"{self.name} unreachable")

    monitors = Monitors([Closing("metrics"), Closing("wandb"), Closing("mlflow", fails=True)])
    with pytest.raises(OSError, match="mlflow unreachable"):
        monitors.close()
    assert closed == ["mlflow", "wandb", "metrics"]
