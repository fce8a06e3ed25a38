"""Alert rules: judge every StepReport and EvalReport (rank 0) and publish what fires.

Rules (ids are `alerts.rules` values, all on by default):

- `nonfinite`: the loss, the validation loss or the gradient norm is NaN/inf. An fp16 step whose
  gradients overflowed (`report.skipped`) is the loss scaler's business, not an alert.
- `loss_spike`, `grad_spike`: robust z-score of the value against the last `window` steps
  (median/MAD of their residuals around a Theil-Sen trend line, so a fast-falling early loss is
  not noise), above `loss_spike_z` / `grad_spike_z`. Only rises count.
- `throughput_drop`: tokens/s (the median of the last 3 steps) below `throughput_drop` times the
  rolling median of the window. When the training thread spent half or more of those steps
  waiting for a CPU (monitor/host.py), the message says so: the machine is busy with other work,
  and the run itself is not to blame.
- `memory_growth`: peak memory rose at three quarters of the window's steps or more and by more
  than `memory_growth_bytes_per_step` per step over the window (a leak, not one-off growth). The
  message names the phase that keeps the growth (the window's `mem_growth_by_phase`, measured at
  phase changes: diagnose/phase_memory.py).
- `val_regression`: validation loss `val_regression` (a fraction) above its best so far.
- `mix_drift`: a source's share of the rows training took (counted as delivered, all ranks;
  data/loader.py `DeliveredMix`) is `mix_drift` (absolute) off its weight's share, over the most
  recent records that together hold at least 4 / `mix_drift` rows. The mixture's stride schedule
  keeps any run of n rows within 2 rows per source of the weights, so a correct loader stays within
  `mix_drift` / 2 and is never judged on too few rows.
- Reinforcement learning (a step record with GRPO's figures, train/grpo.py), judged from the first
  step: `reward_collapse`, the mean reward of the last 3 steps below its best such mean by
  `reward_collapse` of the range the run's rewards have spanned and by more than 5 standard
  deviations of such a fall under the rewards' step-to-step noise (`step_noise`: a step's reward
  moves with the prompts it drew, and the best of many noisy 3-step means is a lucky one, so
  without it a healthy run fires) (a policy that unlearns what it was rewarded for: too high a
  learning rate, a reward it found a way around);
  `entropy_collapse`, the mean entropy a completion token below `entropy_collapse` of its first
  logged value (every sample becomes the same answer and exploration ends); `kl_blowup`, the mean
  KL to the reference above `kl_blowup`; `zero_std_groups`, every group's rewards equal in
  `zero_std_steps` logged steps in a row (all advantages 0: the step trains nothing). GRPO's loss
  is a surrogate whose value has no trend to spike from: `loss_spike` does not judge it.
- Mixture of experts (a logged step's `experts`, train/experts.py): `dead_expert`, an expert of
  some MoE layer that got no token in `expert_records` logged records in a row (its weights no
  longer train: a collapsed router, a bias run away); `expert_imbalance`, a layer whose busiest
  expert got `expert_imbalance` times the mean or more in `expert_records` records in a row.
- `stall`: no step finished for `stall_s` seconds. A heartbeat thread watches, so the alert
  comes while the loop is stuck, and says the phase and step the phase tracker shows.
- `straggler`: per-rank step time and data wait are compared each logging interval; a rank slower
  than the others by the robust rule for 3 intervals in a row is an alert naming rank, host and
  where its time goes (data, compute, communication). Ranks run in lockstep, so the slow rank's
  time is the others' wait: on logged steps every rank times its wait in tiny all-reduces at the
  step's start, after each micro-batch's data and after backward (train/stragglers.py), and a
  rank's lateness is the median of the others' waits at the data and backward probes less its own
  (the start probe absorbs what came before the step, such as rank 0's records). The most late
  rank is late when that exceeds `straggler_frac` times the median step time (at least 5 ms) and,
  with 4 ranks or more, lies over 3 robust sigmas (median/MAD over the ranks) above the rest.
  Where its time goes: of data (the data phase, its own work), compute (forward + backward +
  optimizer, with the communication FSDP/DDP overlap with backward) and communication (the
  exposed part, grad_sync), the one in which it spends the most more than the others' median.
  A slower compute rank under FSDP or DDP makes the others wait inside backward's own
  collectives, which the probes do not see: only its lateness after the last of them (and at its
  data) counts.

Warm-up: the rules that compare with history (spikes, throughput, memory) judge a step
only once the LR warmup is over (the LR stopped rising) and `window` steps have been seen since;
the first steps of a run (allocator, optimizer state, compilation) and the warmup's large early
updates are never judged. A rule fires again only `repeat_after_s` after it last fired.
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable

from trainbook.config import AlertsConfig
from trainbook.config.secrets import is_redacted
from trainbook.monitor.destinations import AlertCommand, Webhook
from trainbook.monitor.report import Alert, EvalReport, RunInfo, StepReport
from trainbook.monitor.sinks import Monitors, Sink

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation
RECENT = 3  # steps whose median throughput is compared with the window's
NOISE_Z = 5  # reward_collapse: a fall beyond this many standard deviations of two RECENT-step means' difference
STARVED = 0.5  # share of a step a thread waited for a CPU that names contention as the cause of a drop
STRAGGLER_INTERVALS = 3  # logged steps in a row with the same rank late
STRAGGLER_MIN_S = 0.005  # lateness below this is timer and scheduler noise on any machine
STRAGGLER_Z = 3.0  # with 4 ranks or more, the late rank must stand out of the others too
STRAGGLER_WHERE = {"data": ("data loading", "data"), "compute": ("compute", "forward + backward + optimizer"),
                   "comm": ("communication", "exposed communication")}


def step_noise(values: list[float]) -> float:
    """The noise of one step's value around its trend, robustly: the MAD of successive
    differences (a trend barely moves it, a jump is one outlier), scaled to a standard deviation
    of the difference (1.4826) and of one value (/ sqrt 2). 0 with fewer than 3 values."""
    diffs = [b - a for a, b in zip(values, values[1:])]
    if len(diffs) < 2:
        return 0.0
    mid = statistics.median(diffs)
    return 1.4826 * statistics.median(abs(d - mid) for d in diffs) / math.sqrt(2)


def robust_z(value: float, history: deque[float]) -> tuple[float, float]:
    """How many robust standard deviations `value` lies above the trend of `history`, and the
    trend's value at this step.

    The trend is a Theil-Sen line (the median of pairwise slopes), so a loss that is still
    falling fast is not read as noise; the spread is the MAD of the residuals around it, times
    1.4826 (a normal distribution's sigma). With a flat history this is the plain median/MAD
    z-score.
    """
    ys = list(history)
    n = len(ys)
    slope = statistics.median((ys[j] - ys[i]) / (j - i) for i in range(n) for j in range(i + 1, n))
    intercept = statistics.median(y - slope * i for i, y in enumerate(ys))
    residuals = [y - (intercept + slope * i) for i, y in enumerate(ys)]
    center = statistics.median(residuals)
    mad = statistics.median(abs(r - center) for r in residuals)
    expected = intercept + slope * n + center
    # A smooth history (MAD near 0) would make any wobble a spike: the spread is at least 1% of
    # the level, so a step within a few percent of its trend never fires.
    scale = max(MAD_TO_SIGMA * mad, 1e-2 * abs(expected), 1e-12)
    return (value - expected) / scale, expected


def _spread_z(values: list[float], i: int) -> float:
    """How many robust standard deviations (median/MAD over all of `values`) values[i] lies above the median."""
    center = statistics.median(values)
    mad = statistics.median(abs(v - center) for v in values)
    return (values[i] - center) / max(MAD_TO_SIGMA * mad, 1e-12)


class AlertRules(Sink):
    """The rules of `cfg.rules`; each fired alert goes to `publish` (the run's `Monitors.on_alert`)."""

    def __init__(self, cfg: AlertsConfig, info: RunInfo, publish: Callable[[Alert], None]):
        self.cfg = cfg
        self.info = info
        self.publish = publish
        self.on = set(cfg.rules)
        self._lock = threading.Lock()  # the heartbeat thread fires too
        self._last_fired: dict[str, float] = {}
        self._last_lr: float | None = None
        self._warm_steps = 0  # steps seen since the LR warmup ended
        self._history = {key: deque(maxlen=cfg.window)
                         for key in ("loss", "grad_norm", "tokens_per_s", "mem", "cpu_wait", "mem_phases")}
        self._mix_rows: deque[dict[str, dict]] = deque()  # the newest data_mix records that judge the mixture
        self._best_val: float | None = None
        self._late: tuple[int, int] | None = None  # (rank, logged steps in a row it was the late one)
        self._rewards: deque[float] = deque(maxlen=cfg.window)  # GRPO: the last steps' mean rewards
        self._reward_best: float | None = None  # the best mean of RECENT of them
        self._reward_range: tuple[float, float] | None = None  # the lowest and highest step reward seen
        self._first_entropy: float | None = None
        self._flat_steps = 0  # logged steps in a row whose groups all had equal rewards
        self._idle: dict[tuple[str, int], int] = {}  # (layer, expert) -> records in a row without a token
        self._skewed: dict[str, int] = {}  # layer -> records in a row over expert_imbalance
        self._last_progress = time.monotonic()
        self._stop = threading.Event()
        self._heartbeat = None
        if "stall" in self.on:
            self._heartbeat = threading.Thread(target=self._watch_stall, name="trainbook-stall", daemon=True)
            self._heartbeat.start()

    # ---- step and eval rules --------------------------------------------------------------

    def on_step(self, r: StepReport) -> None:
        self._last_progress = time.monotonic()
        if not math.isfinite(r.loss):
            self._fire("nonfinite", r.loss, r.step, f"training loss is {r.loss}")
        elif not r.skipped and not math.isfinite(r.grad_norm):
            self._fire("nonfinite", r.grad_norm, r.step, f"gradient norm is {r.grad_norm} (loss {r.loss:.4f})")
        rl = r.objective if r.objective is not None and "reward" in r.objective else None
        if self._warmed_up(r):
            self._judge_history(r, judge_loss=rl is None)
        if rl is not None:
            self._judge_rl(rl, r.step)
        self._judge_mix(r)
        self._judge_stragglers(r)
        if r.experts is not None:
            self._judge_experts(r.experts, r.step)
        self._remember(r)

    def on_eval(self, r: EvalReport) -> None:
        self._last_progress = time.monotonic()
        if not math.isfinite(r.val_loss):
            self._fire("nonfinite", r.val_loss, r.step, f"validation loss is {r.val_loss}")
            return
        best = self._best_val
        limit = None if best is None else best * (1 + self.cfg.val_regression)
        if limit is not None and r.val_loss > limit:
            self._fire("val_regression", r.val_loss, r.step,
                       f"validation loss {r.val_loss:.4f} is {r.val_loss / best - 1:.1%} above its best {best:.4f}",
                       threshold=limit)
        self._best_val = r.val_loss if best is None else min(best, r.val_loss)

    def _warmed_up(self, r: StepReport) -> bool:
        """True once the LR stopped rising and a full window of steps has been seen since."""
        rising = self._last_lr is not None and r.lr > self._last_lr
        self._last_lr = r.lr
        if self._warm_steps == 0 and (rising or r.step == 1):
            for history in self._history.values():
                history.clear()  # warmup values are no yardstick for the rest of the run
            return False
        self._warm_steps += 1
        return self._warm_steps > self.cfg.window

    def _judge_history(self, r: StepReport, judge_loss: bool = True) -> None:
        h, c = self._history, self.cfg
        if judge_loss and math.isfinite(r.loss):
            z, expected = robust_z(r.loss, h["loss"])
            if z > c.loss_spike_z:
                self._fire("loss_spike", r.loss, r.step, f"loss {r.loss:.4f} is {z:.1f} robust sigmas above its "
                           f"trend {expected:.4f} over the last {len(h['loss'])} steps", threshold=c.loss_spike_z)
        if not r.skipped and math.isfinite(r.grad_norm):
            z, expected = robust_z(r.grad_norm, h["grad_norm"])
            if z > c.grad_spike_z:
                self._fire("grad_spike", r.grad_norm, r.step, f"gradient norm {r.grad_norm:.4g} is {z:.1f} robust "
                           f"sigmas above its trend {expected:.4g} over the last {len(h['grad_norm'])} steps",
                           threshold=c.grad_spike_z)
        # The last RECENT steps' median: one slow step (a hiccup of a shared machine, a long
        # data fetch) is no drop; one stuck long is the stall rule's.
        median_tps = statistics.median(h["tokens_per_s"])
        recent = statistics.median([*list(h["tokens_per_s"])[-(RECENT - 1):], r.tokens_per_s])
        if recent < c.throughput_drop * median_tps:
            waits = [w for w in [*list(h["cpu_wait"])[-(RECENT - 1):], r.cpu_wait_share] if w is not None]
            busy = statistics.median(waits) if waits else 0.0
            cause = (f"; a thread of the run waited for a CPU {busy:.0%} of that time: the machine is busy "
                     "with other work" if busy >= STARVED else "")
            self._fire("throughput_drop", recent, r.step,
                       f"{recent:,.0f} tokens/s over the last {RECENT} steps is {recent / median_tps:.0%} of the "
                       f"rolling median {median_tps:,.0f}{cause}", threshold=c.throughput_drop * median_tps)
        self._judge_memory(r)

    def _judge_rl(self, rl: dict, step: int) -> None:
        """GRPO's figures (train/grpo.py) against the RL rules."""
        c = self.cfg
        reward = rl["reward"]
        if math.isfinite(reward):
            lo, hi = self._reward_range or (reward, reward)
            self._reward_range = (min(lo, reward), max(hi, reward))
            self._rewards.append(reward)
            if len(self._rewards) >= RECENT:
                recent = statistics.mean(list(self._rewards)[-RECENT:])
                best, span = self._reward_best, self._reward_range[1] - self._reward_range[0]
                noise = NOISE_Z * step_noise(list(self._rewards)) * math.sqrt(2 / RECENT)
                margin = max(c.reward_collapse * span, noise)
                if best is not None and span > 0 and recent < best - margin:
                    self._fire("reward_collapse", recent, step,
                               f"the mean reward of the last {RECENT} steps, {recent:.4g}, fell {best - recent:.4g} "
                               f"below its best {best:.4g} ({(best - recent) / span:.0%} of the range {span:.4g} the "
                               f"run's rewards have spanned, {(best - recent) / noise if noise else math.inf:.1f} times "
                               f"the {noise:.3g} a {RECENT}-step mean's noise reaches): the policy is unlearning what "
                               "it was rewarded for", threshold=best - margin)
                self._reward_best = recent if best is None else max(best, recent)
        entropy = rl.get("entropy")
        if entropy is not None and math.isfinite(entropy):
            first = self._first_entropy
            if first is None:
                self._first_entropy = entropy
            elif entropy < c.entropy_collapse * first:
                self._fire("entropy_collapse", entropy, step,
                           f"the policy's entropy, {entropy:.4g} nats a completion token, is {entropy / first:.1%} of "
                           f"its first {first:.4g}: its samples are becoming one answer and exploration ends",
                           threshold=c.entropy_collapse * first)
        kl = rl.get("kl")
        if kl is not None and math.isfinite(kl) and kl > c.kl_blowup:
            self._fire("kl_blowup", kl, step, f"the KL to the reference, {kl:.4g} a completion token, is above "
                       f"{c.kl_blowup:g}: the policy has moved far from where it started", threshold=c.kl_blowup)
        flat = rl.get("frac_reward_zero_std")
        self._flat_steps = self._flat_steps + 1 if flat is not None and flat >= 1.0 else 0
        if self._flat_steps >= c.zero_std_steps:
            self._fire("zero_std_groups", flat, step,
                       f"every group's rewards were equal in the last {self._flat_steps} logged steps: every advantage "
                       "is 0 and the steps train nothing (the rewards cannot tell a group's completions apart: "
                       "the prompts are too hard or too easy, or a reward ignores the completion)",
                       threshold=1.0)

    def _judge_experts(self, load: dict[str, dict], step: int) -> None:
        c = self.cfg
        for layer, v in load.items():
            for e, tokens in enumerate(v["tokens"]):
                self._idle[layer, e] = self._idle.get((layer, e), 0) + 1 if tokens == 0 else 0
            skewed = v["imbalance"] is not None and v["imbalance"] >= c.expert_imbalance
            self._skewed[layer] = self._skewed.get(layer, 0) + 1 if skewed else 0
        dead = sorted(key for key, n in self._idle.items() if n >= c.expert_records)
        if dead:
            layers = {name: [e for n, e in dead if n == name] for name, _ in dead}
            self._fire("dead_expert", float(len(dead)), step,
                       f"{len(dead)} expert(s) got no token in the last {c.expert_records} logged records, their weights "
                       "no longer training (a collapsed router; experts.jsonl): "
                       + "; ".join(f"{name}: {', '.join(map(str, es))}" for name, es in layers.items()),
                       threshold=float(c.expert_records))
        skewed = [layer for layer, n in self._skewed.items() if n >= c.expert_records]
        if skewed:
            worst = max(skewed, key=lambda name: load[name]["imbalance"])
            v = load[worst]
            busiest = max(range(len(v["tokens"])), key=v["tokens"].__getitem__)
            self._fire("expert_imbalance", v["imbalance"], step,
                       f"{worst}: expert {busiest} got {v['imbalance']:.2f}x the mean tokens, {c.expert_records} logged "
                       f"records in a row (router entropy {v['entropy']} nats); set moe.balance or raise its strength",
                       threshold=c.expert_imbalance)

    def _judge_memory(self, r: StepReport) -> None:
        mem = [*self._history["mem"], r.mem_peak_bytes]
        rises = sum(b > a for a, b in zip(mem, mem[1:]))
        slope = (mem[-1] - mem[0]) / (len(mem) - 1)
        limit = self.cfg.memory_growth_bytes_per_step
        if rises >= 0.75 * (len(mem) - 1) and slope > limit:
            self._fire("memory_growth", slope, r.step, f"peak memory grew {slope / 2**20:,.1f} MiB per step over "
                       f"the last {len(mem) - 1} steps (now {r.mem_peak_bytes / 2**30:.2f} GiB)"
                       + self._growing_phase(r), threshold=limit)

    def _growing_phase(self, r: StepReport) -> str:
        """"; it grows in phase P (share of the window's kept growth, MiB per step)", or nothing."""
        steps = [*self._history["mem_phases"], r.mem_growth_by_phase]
        totals: dict[str, int] = {}
        for phases in filter(None, steps):
            for phase, grown in phases.items():
                totals[phase] = totals.get(phase, 0) + grown
        kept = sum(totals.values())
        if kept <= 0:
            return ""
        phase, grown = max(totals.items(), key=lambda item: item[1])
        return (f"; it grows in phase {phase} ({grown / kept:.0%} of the growth kept, "
                f"{grown / len(steps) / 2**20:,.1f} MiB per step)")

    def _judge_mix(self, r: StepReport) -> None:
        if not r.data_mix:
            return
        need = 4 / self.cfg.mix_drift
        self._mix_rows.appendleft(r.data_mix)
        total = 0
        for kept, mix in enumerate(self._mix_rows, 1):  # newest first, until enough rows
            total += sum(m["rows"] for m in mix.values())
            if total >= need:
                break
        else:
            return
        while len(self._mix_rows) > kept:
            self._mix_rows.pop()
        shares = {source: (sum(mix[source]["rows"] for mix in self._mix_rows) / total, m["target"])
                  for source, m in r.data_mix.items()}
        source, (share, target) = max(shares.items(), key=lambda item: abs(item[1][0] - item[1][1]))
        if abs(share - target) > self.cfg.mix_drift:  # the source furthest off speaks for the mixture
            self._fire("mix_drift", share, r.step, f"source '{source}' is {share:.1%} of the last {total:,} "
                       f"rows trained on, its weight asks {target:.1%}", threshold=self.cfg.mix_drift)

    def _judge_stragglers(self, r: StepReport) -> None:
        t = r.rank_times
        if t is None:  # not a logged step, or one process
            return
        late = t.lateness()
        rank = max(range(len(late)), key=late.__getitem__)
        limit = max(self.cfg.straggler_frac * statistics.median(t.step_time_s), STRAGGLER_MIN_S)
        if late[rank] <= limit or (len(late) >= 4 and _spread_z(late, rank) <= STRAGGLER_Z):
            self._late = None
            return
        runs = self._late[1] + 1 if self._late is not None and self._late[0] == rank else 1
        self._late = (rank, runs)
        if runs < STRAGGLER_INTERVALS:
            return
        excess = t.excess(rank)
        key = max(excess, key=lambda k: excess[k][0] - excess[k][1])
        (mine, median), (where, label) = excess[key], STRAGGLER_WHERE[key]
        self._fire("straggler", late[rank], r.step,
                   f"rank {rank} (host {t.hosts[rank]}) is the straggler for {runs} probed intervals: the others "
                   f"wait {late[rank]:.3f} s a step for it; its time goes to {where} ({label} {mine:.3f} s vs "
                   f"median {median:.3f} s)", threshold=limit)

    def _remember(self, r: StepReport) -> None:
        h = self._history
        if math.isfinite(r.loss):
            h["loss"].append(r.loss)
        if not r.skipped and math.isfinite(r.grad_norm):
            h["grad_norm"].append(r.grad_norm)
        h["tokens_per_s"].append(r.tokens_per_s)
        h["mem"].append(r.mem_peak_bytes)
        h["cpu_wait"].append(r.cpu_wait_share)
        h["mem_phases"].append(r.mem_growth_by_phase)

    # ---- stall: the heartbeat thread ------------------------------------------------------

    def _watch_stall(self) -> None:
        tick = min(0.25, self.cfg.stall_s / 4)
        fired_for = None  # the progress time a stall alert was already sent for
        while not self._stop.wait(tick):
            since = self._last_progress
            idle = time.monotonic() - since
            if idle < self.cfg.stall_s or fired_for == since:
                continue
            state = self.info.tracker.current() if self.info.tracker is not None else None
            where = "" if state is None else (
                f"; step {state.step} is in phase {state.phase.value}"
                f"{f' ({state.detail})' if state.detail else ''} for {time.monotonic() - state.since:.1f} s")
            if self._fire("stall", idle, state.step if state else 0,
                          f"no step finished for {idle:.1f} s{where}", threshold=self.cfg.stall_s):
                fired_for = since

    # ---- firing ---------------------------------------------------------------------------

    def _fire(self, rule: str, value: float, step: int, message: str, threshold: float | None = None) -> bool:
        """Publish an alert unless the rule is off or fired less than `repeat_after_s` ago."""
        if rule not in self.on:
            return False
        now = time.monotonic()
        with self._lock:
            last = self._last_fired.get(rule)
            if last is not None and now - last < self.cfg.repeat_after_s:
                return False
            self._last_fired[rule] = now
        self.publish(Alert(run=self.info.run_name, rank=self.info.rank, rule=rule, value=value, step=step,
                           time=time.time(), message=message, threshold=threshold))
        return True

    def close(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()


def add_alerts(monitors: Monitors, info: RunInfo, cfg: AlertsConfig, logger) -> None:
    """Rank 0: the destinations of `cfg`, then the rules, which publish through `monitors` (so every
    sink, the log and events.jsonl included, sees each alert). Closed in reverse: the rules stop
    firing before the destinations drain."""
    url = os.environ.get(cfg.webhook_url_env, "") if cfg.webhook_url_env else cfg.webhook_url
    if is_redacted(url):  # a config read back from an archive: the secret was never written
        logger.warning(f"alerts.webhook_url is {url} (an archived config holds no secret): alerts post "
                       "nowhere; give it with alerts.webhook_url_env")
    elif url:
        monitors.add(Webhook(url, cfg.webhook_timeout_s, cfg.webhook_retries, logger))
    if cfg.command:
        monitors.add(AlertCommand(cfg.command, cfg.webhook_timeout_s, logger))
    if cfg.rules:
        monitors.add(AlertRules(cfg, info, monitors.on_alert))
