"""A Prometheus endpoint on rank 0 (`monitor.prometheus_port`, `monitor.prometheus_host`).

The metrics live in the sink's own `CollectorRegistry` (never the client's global one), served by
the client's HTTP server on a background thread until `close`. Every metric carries `run` (the
run name) and `rank` (whose value it is: rank 0 for the run's own numbers, each rank for the
`trainbook_rank_*` spread), so one Prometheus can scrape many runs. Gauges follow every step; the
per-rank spread arrives at the logging cadence. `METRICS` is the list the shipped Grafana
dashboard (launch/grafana-dashboard.json) may use; a test holds the two together.
"""

from __future__ import annotations

import errno
import socket

from trainbook.errors import TrainbookError
from trainbook.monitor.report import Alert, EvalReport, StepReport
from trainbook.monitor.sinks import Sink

# name -> (kind, help, extra labels besides run and rank)
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "trainbook_step": ("gauge", "Optimizer steps completed", ()),
    "trainbook_tokens": ("gauge", "Tokens trained on so far", ()),
    "trainbook_loss": ("gauge", "Training loss of the last step", ()),
    "trainbook_val_loss": ("gauge", "Validation loss of the last evaluation", ()),
    "trainbook_lr": ("gauge", "Learning rate of the last step", ()),
    "trainbook_grad_norm": ("gauge", "Gradient norm before clipping of the last finite step", ()),
    "trainbook_tokens_per_second": ("gauge", "Training throughput of the last step", ()),
    "trainbook_mfu": ("gauge", "Model FLOPs utilisation of the last step (when the device peak is known)", ()),
    "trainbook_step_time_seconds": ("gauge", "Wall time of the last step", ()),
    "trainbook_phase_seconds": ("gauge", "Seconds of the last step spent in each phase", ("phase",)),
    "trainbook_data_wait_share": ("gauge", "Share of the last step spent waiting for data", ()),
    "trainbook_cpu_wait_share": ("gauge", "Longest wait for a CPU of any thread in the last step, as a share of the step", ()),
    "trainbook_memory_peak_bytes": ("gauge", "Peak device memory of the last step", ()),
    "trainbook_loss_scale": ("gauge", "fp16 loss scale of the last step", ()),
    "trainbook_skipped_steps": ("gauge", "fp16 steps skipped so far (gradient overflow)", ()),
    "trainbook_last_step_timestamp_seconds": ("gauge", "Unix time the last step completed", ()),
    "trainbook_alerts": ("counter", "Alerts fired, by rule", ("rule",)),
    "trainbook_rank_step_time_seconds": ("gauge", "Each rank's step time (logging cadence)", ()),
    "trainbook_rank_data_wait_seconds": ("gauge", "Each rank's data wait (logging cadence)", ()),
    "trainbook_rank_memory_peak_bytes": ("gauge", "Each rank's peak memory (logging cadence)", ()),
}


def exported_names() -> set[str]:
    """Every series name a scrape shows (a counter `x` is exposed as `x_total` and `x_created`)."""
    names = set()
    for name, (kind, _, _) in METRICS.items():
        names |= {f"{name}_total", f"{name}_created"} if kind == "counter" else {name}
    return names


def check_endpoint(host: str, port: int) -> None:
    """Fail as a user error, before anything is written, when `host:port` cannot be served."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise TrainbookError(f"{host!r} is not an address of this machine ({e})",
                             where="monitor.prometheus_host") from None
    with socket.socket(family, kind, proto) as s:
        # As the HTTP server does: a port left in TIME_WAIT by an earlier run is free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                raise TrainbookError(f"cannot serve on port {port} of {host}: {e.strerror}; choose a free "
                                     "port, or 0 (off)", where="monitor.prometheus_port") from None
            raise TrainbookError(f"cannot bind {host}: {e.strerror}", where="monitor.prometheus_host") from None


class PrometheusSink(Sink):
    def __init__(self, host: str, port: int, run: str, rank: int):
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

        self.registry = CollectorRegistry()
        self.run, self.rank = run, str(rank)
        kinds = {"gauge": Gauge, "counter": Counter}
        self._metrics = {
            name: kinds[kind](name, doc, ["run", "rank", *extra], registry=self.registry)
            for name, (kind, doc, extra) in METRICS.items()
        }
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:  # taken between the pre-flight check and now
            raise TrainbookError(f"cannot serve on {host}:{port}: {e.strerror}",
                                 where="monitor.prometheus_port") from None

    def _set(self, name: str, value: float | None, rank: str | None = None, **labels: str) -> None:
        if value is not None:
            self._metrics[name].labels(run=self.run, rank=rank or self.rank, **labels).set(value)

    def on_step(self, r: StepReport) -> None:
        self._set("trainbook_tokens", r.tokens)
        self._set("trainbook_loss", r.loss)
        self._set("trainbook_lr", r.lr)
        if r.grad_norm == r.grad_norm and abs(r.grad_norm) != float("inf"):  # a skipped step's is inf
            self._set("trainbook_grad_norm", r.grad_norm)
        self._set("trainbook_tokens_per_second", r.tokens_per_s)
        self._set("trainbook_mfu", r.mfu)
        self._set("trainbook_step_time_seconds", r.step_time_s)
        for phase, seconds in r.phases.items():
            self._set("trainbook_phase_seconds", seconds, phase=phase)
        self._set("trainbook_data_wait_share", r.data_wait_share)
        self._set("trainbook_cpu_wait_share", r.cpu_wait_share)
        self._set("trainbook_memory_peak_bytes", r.mem_peak_bytes)
        self._set("trainbook_loss_scale", r.loss_scale)
        self._set("trainbook_skipped_steps", r.skipped_steps)
        self._set("trainbook_last_step_timestamp_seconds", r.time or None)
        if r.ranks is not None:
            for rank, (step_time, wait, mem) in enumerate(zip(r.ranks.step_time_s, r.ranks.data_wait_s,
                                                              r.ranks.mem_peak_bytes)):
                self._set("trainbook_rank_step_time_seconds", step_time, rank=str(rank))
                self._set("trainbook_rank_data_wait_seconds", wait, rank=str(rank))
                self._set("trainbook_rank_memory_peak_bytes", mem, rank=str(rank))
        self._set("trainbook_step", r.step)  # last: once a scrape shows step N, all of step N is there

    def on_eval(self, r: EvalReport) -> None:
        self._set("trainbook_val_loss", r.val_loss)

    def on_alert(self, alert: Alert) -> None:
        self._metrics["trainbook_alerts"].labels(run=self.run, rank=str(alert.rank), rule=alert.rule).inc()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
