"""`[log]`, `[monitor]` and `[alerts]`: what a run writes about itself, where else its metrics go,
and the rules that watch it (`ALERT_RULES`: every rule id `alerts.rules` accepts)."""

from __future__ import annotations

import urllib.parse
from typing import Literal

from pydantic import Field, field_validator

from trainbook.config.secrets import is_redacted
from trainbook.config.section import Section


class LogConfig(Section):
    every_steps: int = Field(default=10, ge=1)
    """Write metrics and a log line every N steps."""
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level of the run log files."""
    retention_days: int = Field(default=30, ge=1)
    """Delete per-day log files older than this."""
    progress: Literal["auto", "bar", "plain"] = "auto"
    """`auto`: a progress bar on a terminal, plain log lines otherwise."""


class MonitorConfig(Section):
    """Where a run's facts go besides metrics.jsonl, events.jsonl and the logs (always written).
    Key names are a contract that scripts use."""

    tensorboard: bool = True
    """Write TensorBoard event files to `<run>/tb/`: scalars, and histograms of the layer statistics."""
    prometheus_port: int = Field(default=0, ge=0, le=65535)
    """Serve Prometheus metrics on this port (rank 0); 0 = off."""
    prometheus_host: str = "127.0.0.1"
    """Address the Prometheus endpoint binds to: localhost unless you mean otherwise."""
    layer_stats_every: int = Field(default=100, ge=0)
    """Every N steps: per block and parameter group gradient/parameter norms, update-to-weight
    ratio and activation statistics (`layers.jsonl`, TensorBoard); 0 = off."""
    wandb: bool = False
    """Log to Weights & Biases (`pip install trainbook[wandb]`); offline unless `WANDB_MODE` says otherwise."""
    wandb_project: str | None = None
    """W&B project; unset: the run name."""
    mlflow: bool = False
    """Log to MLflow (`pip install trainbook[mlflow]`)."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI; unset: a local file store in `<run>/mlruns`."""
    tracker_close_timeout_s: float = Field(default=60.0, gt=0)
    """At the end of a run, how long W&B and MLflow may take to send what is still queued (they log
    from a background thread, so a slow server never holds up a step); past it the rest is dropped."""


ALERT_RULES = ("nonfinite", "loss_spike", "grad_spike", "throughput_drop", "stall", "memory_growth",
               "val_regression", "mix_drift", "straggler", "reward_collapse", "entropy_collapse", "kl_blowup",
               "zero_std_groups", "dead_expert", "expert_imbalance")


class AlertsConfig(Section):
    """Rules that watch the run, and where a fired alert goes (the log and events.jsonl always)."""

    rules: list[str] = Field(default_factory=lambda: list(ALERT_RULES))
    """Rule ids that are on: nonfinite, loss_spike, grad_spike, throughput_drop, stall,
    memory_growth, val_regression, mix_drift, straggler (per-rank step time and data wait compared
    each logging interval; a rank slower than the others by the robust rule for 3 intervals in a
    row is an alert naming rank, host and where its time goes: data, compute, communication), and
    for reinforcement learning (`[grpo]`) reward_collapse, entropy_collapse, kl_blowup and
    zero_std_groups, and for a mixture of experts dead_expert and expert_imbalance (monitor/alerts.py)."""
    webhook_url: str | None = None
    """POST each alert as JSON here, an http(s) URL (a background thread with timeout and retries;
    never blocks training). A secret: trainbook writes only its fingerprint (`redacted:sha256:...`,
    config/secrets.py), and an archived config that holds one posts nowhere."""
    webhook_url_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """The name of an environment variable holding the webhook URL (instead of `webhook_url`), so
    the secret is in no recipe and no command line; checked before the run starts."""
    command: list[str] | None = Field(default=None, min_length=1)
    """Run this argv (never a shell) for each alert, with the alert as JSON on stdin (timeout:
    `webhook_timeout_s`)."""
    window: int = Field(default=50, ge=5)
    """Steps of history the spike, throughput and memory rules judge a new step against."""
    loss_spike_z: float = Field(default=6.0, gt=0)
    """Robust z-score (median/MAD over `window`) above which a loss is a spike."""
    grad_spike_z: float = Field(default=10.0, gt=0)
    """Robust z-score above which a gradient norm is a spike."""
    throughput_drop: float = Field(default=0.5, gt=0, lt=1)
    """Alert when tokens/s falls below this fraction of the rolling median."""
    stall_s: float = Field(default=600.0, gt=0)
    """Alert when no step has completed for this many seconds (a heartbeat thread watches)."""
    memory_growth_bytes_per_step: int = Field(default=1 << 20, ge=0)
    """Alert when peak memory grows faster than this per step over `window` steps (a leak)."""
    val_regression: float = Field(default=0.05, ge=0)
    """Alert when the validation loss rises this fraction above its best so far."""
    mix_drift: float = Field(default=0.1, gt=0, lt=1)
    """Alert when a source's share of consumed tokens is this far (absolute) from its weight's share."""
    straggler_frac: float = Field(default=0.2, gt=0)
    """A rank is late when the others wait for it more than this fraction of the median step time
    (and at least 5 ms) in a probed step; `straggler` fires after 3 probed steps in a row."""
    straggler_every: int = Field(default=4, ge=1)
    """The straggler probes run on every this-many-th logged step (each probe: device syncs and a
    one-element all-reduce of the world, 2 + accumulation of them in a probed step). Measured by
    benchmarks/stragglers.py (2 ranks, gloo, the default recipe): a probed step costs 3.4% more; at
    the default `log.every_steps` (10) every 4th logged step keeps the average under 0.1%, and a
    straggler is named after 3 probed intervals (120 steps)."""
    reward_collapse: float = Field(default=0.5, gt=0, le=1)
    """GRPO: alert when the mean reward of the last 3 steps falls below its best such mean by this
    fraction of the range the run's step rewards have spanned (and by more than the rewards'
    step-to-step noise explains: monitor/alerts.py)."""
    entropy_collapse: float = Field(default=0.1, gt=0, lt=1)
    """GRPO: alert when the policy's mean entropy a completion token falls below this fraction of
    its value at the run's first logged step."""
    kl_blowup: float = Field(default=1.0, gt=0)
    """GRPO with kl_coef > 0: alert when the mean KL to the reference a completion token exceeds this."""
    zero_std_steps: int = Field(default=3, ge=1)
    """GRPO: alert when every group's rewards were equal (frac_reward_zero_std = 1: no advantage,
    nothing trained) in this many logged steps in a row."""
    expert_imbalance: float = Field(default=3.0, gt=1)
    """Mixture of experts: alert when a layer's busiest expert got this many times the mean
    tokens (max / mean; every token sent to the same k of E experts: E / k) in `expert_records`
    logged records in a row."""
    expert_records: int = Field(default=3, ge=1)
    """Mixture of experts: logged records in a row an expert must get no token (`dead_expert`) or
    a layer stay over `expert_imbalance` (`expert_imbalance`) before the alert."""
    webhook_timeout_s: float = Field(default=5.0, gt=0)
    """Timeout of one webhook POST."""
    webhook_retries: int = Field(default=3, ge=0)
    """Retries of a failed POST, with exponential backoff."""
    repeat_after_s: float = Field(default=300.0, ge=0)
    """One rule fires again only after this many seconds (deduplication and rate limit)."""

    @field_validator("webhook_url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        if url is None or is_redacted(url):
            return url
        parts = urllib.parse.urlsplit(url)
        try:
            parts.port  # noqa: B018 - raises on a port that is not a number in range
        except ValueError as e:
            raise ValueError(f"{url!r} is not a valid URL: {e}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname or any(c.isspace() for c in url):
            raise ValueError(f"{url!r} is not an http(s) URL with a host, e.g. 'https://hooks.example.com/alerts'")
        return url

    @field_validator("rules")
    @classmethod
    def _known_rules(cls, rules: list[str]) -> list[str]:
        unknown = [r for r in rules if r not in ALERT_RULES]
        if unknown:
            raise ValueError(f"unknown rule {unknown[0]!r}; rules are {', '.join(ALERT_RULES)}")
        return rules
