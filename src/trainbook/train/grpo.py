"""GRPO (and DAPO, Dr. GRPO) on the objective seam (train/objective.py): a producer that makes
each rollout's micro-batches, and the clipped policy loss over them.

A rollout (`GrpoObjective._rollout`):
1. this rank's prompts for the rollout (`StepCycle`: a pure function of the rollout's number,
   so a resumed run draws the prompts an unbroken one drew);
2. `group_size` completions of each from the rollout engine (model/sampler.py), completion i of
   the rollout drawing from a generator seeded with (run seed, rollout, i): the same draws on
   any number of ranks;
3. every reward function on every completion, in this process or in a pool of worker processes
   (`reward_workers`, reward_pool.py); a function that raises, crashes its worker or
   overruns `reward_timeout_s` is an incident (its rewards for the rollout are None, the message
   kept in `incidents`), not the end of the run;
4. with `filter_zero_std`, more prompts drawn while a rank lacks groups whose rewards differ
   (`_refill`, DAPO's dynamic sampling);
5. advantages per group (train/rl.py), the global counts the loss is normalised by, and, when
   they are needed, the old policy's and the reference's log-probabilities, computed once;
6. micro-batches of prompt + completion, right-padded, the completion's tokens (its stop token
   included) the only ones trained; they serve `updates_per_rollout` optimizer steps.

The loss of a micro-batch is sum(token weight x per-token loss), the weights from the whole
rollout's counts over every rank (`rl.token_weights`), so micro-batches and ranks add up to the
loss of the whole rollout; each rank's backward runs on its sum x dp, which the data-parallel
gradient average turns into the global sum.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from trainbook.config.grpo import GrpoConfig
from trainbook.data.prompts import PromptEncoder, PromptRecord, columns_of
from trainbook.data.sources import prompt_records
from trainbook.data.samples import Batch
from trainbook.data.tokenizer import Tokenizer
from trainbook.errors import TrainbookError
from trainbook.faults import fault_point
from trainbook.model.sampler import RolloutEngine, SamplingParams
from trainbook.parallel.runtime import Runtime
from trainbook.train import rl
from trainbook.train.objective import MicroLoss
from trainbook.reward_pool import RewardPool
from trainbook.scoring import Scorer, call_scorer, load_scorer


class Prompt(NamedTuple):
    ids: list[int]
    record: PromptRecord  # its prompt as given (what reward functions receive) and its columns


class Drawn(NamedTuple):
    """Completions of some prompts (group after group) and their scores: each function's and the total."""

    prompts: list[Prompt]
    completions: list
    texts: list[str]
    per_fn: list[list[float | None]]
    rewards: list[float | None]

    def group(self, g: int, size: int) -> Drawn:
        """Group `g` (its prompt and `size` completions) alone."""
        s = slice(g * size, (g + 1) * size)
        return Drawn([self.prompts[g]], self.completions[s], self.texts[s], [f[s] for f in self.per_fn],
                     self.rewards[s])

    @staticmethod
    def join(parts: list[Drawn]) -> Drawn:
        """The groups of `parts`, one after another."""
        def cat(field) -> list:
            return [x for p in parts for x in field(p)]
        return Drawn(cat(lambda p: p.prompts), cat(lambda p: p.completions), cat(lambda p: p.texts),
                     [cat(lambda p, f=f: p.per_fn[f]) for f in range(len(parts[0].per_fn))], cat(lambda p: p.rewards))


class RolloutBatch(NamedTuple):
    """A micro-batch of a rollout: `Batch`'s fields (prompt + completion, right-padded; the mask
    marks the completion's targets) and what the loss needs per sequence and token."""

    inputs: torch.Tensor  # (B, T)
    targets: torch.Tensor  # (B, T)
    positions: torch.Tensor | None
    sources: torch.Tensor | None
    loss_mask: torch.Tensor  # (B, T) bool
    advantages: torch.Tensor  # (B,)
    weights: torch.Tensor  # (B, T): each trained token's share of the rollout's loss
    old_logp: torch.Tensor | None  # (B, T): the policy that sampled (None: the ratio is 1)
    ref_logp: torch.Tensor | None  # (B, T): the reference (None: no KL term)


@dataclass(frozen=True)
class Reward:
    spec: str
    fn: Scorer
    weight: float
    option: str  # the recipe key that named it

    @property
    def name(self) -> str:
        return self.spec.rpartition(":")[2]


def load_rewards(cfg: GrpoConfig, sample: PromptRecord) -> list[Reward]:
    """The reward functions, each imported and called once on a dummy completion of `sample`
    (its columns as the real calls pass them): a path that does not import, a function with the
    wrong signature, or one that answers the wrong number of values or a non-number is one line
    naming its recipe key, before any rollout."""
    out = []
    for i, spec in enumerate(cfg.reward):
        option = f"grpo.reward[{i}].function"
        fn = load_scorer(spec.function, option)
        call_scorer(fn, spec.function, [sample.prompt], ["0"], columns_of([sample]), option=option, allow_none=True)
        out.append(Reward(spec.function, fn, spec.weight, option))
    return out


def grpo_inputs(cfg, tokenizer: Tokenizer) -> tuple[list[Prompt], list[Reward], set[int]]:
    """The prompts of the recipe's `prompts` sources as the model reads them, the reward
    functions (each answered a dummy completion) and the ids a completion stops at. A prompt
    without room for max_new_tokens within train.seq_len is one line naming its file and line."""
    g, t = cfg.grpo, cfg.train
    encoder = PromptEncoder.of_run(cfg, tokenizer)
    prompts = []
    for i, source in enumerate(cfg.data.sources):
        where = f"data.sources[{i}]"
        for record in prompt_records(source, where):
            ids = encoder.ids(record.prompt, record.where, where)
            if len(ids) + g.max_new_tokens > t.seq_len:
                raise TrainbookError(
                    f"{record.where}: the prompt has {len(ids)} tokens; with grpo.max_new_tokens {g.max_new_tokens} "
                    f"it needs {len(ids) + g.max_new_tokens} positions, more than train.seq_len {t.seq_len}",
                    where=where)
            prompts.append(Prompt(ids, record))
    return prompts, load_rewards(g, prompts[0].record), encoder.stop_ids


class StepCycle:
    """The items of each step: GRPO's prompts of a rollout, DPO's pairs. Step k takes global
    items [k P, (k + 1) P) of an order that is a fresh seeded permutation of every item each
    epoch; data-parallel rank r takes its contiguous share. A pure function of k, so resuming
    needs only the step. `where`: the recipe key of P, for the error when ranks cannot share it."""

    def __init__(self, items: Sequence, per_step: int, seed: int, dp_rank: int = 0, dp: int = 1,
                 where: str = "grpo.prompts_per_step"):
        if per_step % dp:
            raise TrainbookError(f"{per_step} a step do not split over {dp} data-parallel ranks", where=where)
        self.items, self.per_step, self.seed = list(items), per_step, seed
        self.dp_rank, self.local = dp_rank, per_step // dp

    def take(self, step: int) -> list:
        n = len(self.items)
        first = step * self.per_step + self.dp_rank * self.local
        out = []
        for g in range(first, first + self.local):
            epoch, i = divmod(g, n)
            order = np.random.default_rng([self.seed, epoch]).permutation(n)
            out.append(self.items[int(order[i])])
        return out

    def extra(self, step: int, draw: int) -> list:
        """This rank's share of more items for step `step` (its refill `draw` >= 1): a seeded
        choice of distinct items, a pure function of the seed, step, draw and rank."""
        rng = np.random.default_rng([self.seed, step, draw, self.dp_rank])
        n = len(self.items)
        return [self.items[int(i)] for i in rng.choice(n, self.local, replace=self.local > n)]


def completion_seed(seed: int, rollout: int, index: int, draw: int = 0) -> int:
    """The generator seed of completion `index` (over all ranks) of rollout `rollout`; `draw` > 0:
    of its refill `draw` (filter_zero_std)."""
    key = [seed, rollout, index] + ([draw] if draw else [])
    return int(np.random.SeedSequence(key).generate_state(1, np.uint64)[0] >> 1)


class GrpoObjective:
    def __init__(self, cfg: GrpoConfig, rewards: list[Reward], prompts: StepCycle, engine: RolloutEngine,
                 policy: nn.Module, rt: Runtime, *, micro_batch_size: int, decode: Callable[[list[int]], str],
                 stop_ids: set[int], pad_id: int, seed: int, reference: nn.Module | None = None,
                 steps_done: Callable[[], int] | None = None, on_incident: Callable[[int, dict], None] | None = None):
        if cfg.kl_coef > 0 and reference is None:
            raise ValueError("kl_coef > 0 needs a reference model")
        self.cfg, self.rewards, self.prompts, self.engine = cfg, rewards, prompts, engine
        self.policy, self.reference, self.rt = policy, reference, rt
        self.micro_batch_size, self.decode, self.pad_id, self.seed = micro_batch_size, decode, pad_id, seed
        self.params = SamplingParams(cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                                     stop_ids=frozenset(stop_ids))
        # The run's completed steps (its TrainState), read as each rollout begins: a resumed run
        # samples the rollout of its step. None: rollouts count from 0 (tests).
        self.steps_done = steps_done
        # Called with the step and the rollout's record (prompts, completions, each function's
        # rewards, advantages, the errors) when a reward function raised: the run's incident folder.
        self.on_incident = on_incident
        self.pool = RewardPool(cfg.reward_workers) if cfg.reward_workers else None
        self.rollout = 0
        self._times: dict[str, float] = {}
        self.incidents: list[str] = []
        self.last: dict = {}  # the last rollout: prompts, completions, rewards, advantages (incident folders)
        self._rollout_figures: dict = {}
        self._sums = torch.zeros(5, dtype=torch.float64)  # tokens, kl, entropy, low-clipped, high-clipped

    # ---- the producer ----------------------------------------------------------------------

    def produce(self, batches: Iterator[Batch]) -> Iterator[RolloutBatch]:
        """Each rollout's micro-batches, once per update. A run resumed between two updates of
        one rollout samples that rollout again with the weights it resumed with (exact only at
        a rollout's first update: with updates_per_rollout = 1, always)."""
        updates = self.cfg.updates_per_rollout
        while True:
            served = 0
            if self.steps_done is not None:
                self.rollout, served = divmod(self.steps_done(), updates)
            micro = self._rollout(self.rollout)
            for _ in range(updates - served):
                yield from micro
            self.rollout += 1

    def _rollout(self, k: int) -> list[RolloutBatch]:
        cfg, rt = self.cfg, self.rt
        G = cfg.group_size
        self._times = dict.fromkeys(("time/rollout_s", "time/reward_s", "time/reference_s"), 0.0)
        known_incidents = len(self.incidents)
        drawn = self._draw(k, self.prompts.take(k))
        everyone = self._gather(drawn.rewards)  # every rank's, for the figures (and batch scaling)
        self._rollout_figures = self._figures_of(everyone, drawn.per_fn, drawn.completions)
        if cfg.filter_zero_std:
            drawn = self._refill(k, drawn)
            if cfg.scale_rewards == "batch":
                everyone = self._gather(drawn.rewards)
        began = time.perf_counter()
        completions, rewards = drawn.completions, drawn.rewards
        advantages, scored = rl.group_advantages(rewards, G, "none" if cfg.scale_rewards == "batch"
                                                 else cfg.scale_rewards)
        if cfg.scale_rewards == "batch":
            known = [r for r in everyone if r is not None]
            std = torch.tensor(known, dtype=torch.float64).std().item() if len(known) > 1 else 0.0
            advantages = advantages / (std + rl.ADVANTAGE_EPS)
        trains = scored.clone()
        if cfg.mask_truncated:
            trains &= torch.tensor([c.stopped for c in completions])
        if cfg.filter_zero_std:
            trains &= ~torch.tensor(rl.zero_std_groups(rewards, G)).repeat_interleave(G)

        sequences, masks = [], []
        for j, c in enumerate(completions):
            prompt = drawn.prompts[j // G].ids
            sequences.append(prompt + c.ids)
            masks.append((len(prompt) - 1, len(prompt) - 1 + len(c.ids)) if bool(trains[j]) else (0, 0))
        counts = torch.tensor([float(len(sequences)), float(sum(b - a for a, b in masks))], device=rt.device)
        total_sequences, total_tokens = (round(x) for x in rt.all_reduce_mean(counts, over=rt.dims.tp).tolist())

        micro = []
        for lo in range(0, len(sequences), self.micro_batch_size):
            hi = lo + self.micro_batch_size
            micro.append(self._micro_batch(sequences[lo:hi], masks[lo:hi], advantages[lo:hi], total_sequences,
                                           total_tokens))
        self._times["time/reference_s"] = time.perf_counter() - began
        records = [p.record for p in drawn.prompts]
        self.last = {"rollout": k, "prompts": [r.prompt for r in records for _ in range(G)], "completions": drawn.texts,
                     "rewards_by_function": {r.name: s for r, s in zip(self.rewards, drawn.per_fn)},
                     "rewards": rewards, "advantages": advantages.tolist()}
        errors = self.incidents[known_incidents:]
        if errors and self.on_incident is not None:
            self.on_incident(self._step(), {**self.last, "errors": errors})
        return micro

    def _draw(self, k: int, prompts: list[Prompt], draw: int = 0) -> Drawn:
        """`group_size` completions of each of this rank's `prompts`, scored; `draw` > 0: a
        refill of rollout k (its completions seeded apart from the rollout's own)."""
        G, P = self.cfg.group_size, self.cfg.prompts_per_step
        first = ((k if draw == 0 else draw) * P + self.prompts.dp_rank * self.prompts.local) * G
        seeds = [completion_seed(self.seed, k, first + i, draw) for i in range(len(prompts) * G)]
        began = time.perf_counter()
        completions = self.engine.generate([p.ids for p in prompts for _ in range(G)], seeds, self.params)
        sampled = time.perf_counter()
        fault_point("grpo.rollout", self._step())  # a kill between sampling and scoring
        texts = [self.decode(c.ids[:-1] if c.stopped else c.ids) for c in completions]
        per_fn = [self._score(r, [p.record for p in prompts], texts) for r in self.rewards]
        self._times["time/rollout_s"] += sampled - began
        self._times["time/reward_s"] += time.perf_counter() - sampled
        return Drawn(prompts, completions, texts, per_fn, rl.total_rewards(per_fn, [r.weight for r in self.rewards]))

    def _refill(self, k: int, drawn: Drawn) -> Drawn:
        """DAPO's dynamic sampling: while any rank has fewer groups whose rewards differ than its
        share of the rollout, every rank draws its share of prompts again (`StepCycle.extra`)
        and keeps the groups that differ, up to `filter_max_draws` draws in all. This rank's
        batch: its first such groups, then, if still short, the first draw's
        equal-reward groups (which train nothing). Every rank draws as often as the others: a
        sharded model samples in step."""
        G, local = self.cfg.group_size, self.prompts.local
        draws, first_flat = [drawn], rl.zero_std_groups(drawn.rewards, G)
        useful = [(0, g) for g, flat in enumerate(first_flat) if not flat]
        while len(draws) < self.cfg.filter_max_draws and self._anyone(len(useful) < local):
            more = self._draw(k, self.prompts.extra(k, len(draws)), draw=len(draws))
            useful += [(len(draws), g) for g, flat in enumerate(rl.zero_std_groups(more.rewards, G)) if not flat]
            draws.append(more)
        self._rollout_figures["rollout/draws"] = len(draws)
        fillers = [(0, g) for g, flat in enumerate(first_flat) if flat]
        chosen = sorted((useful + fillers)[:local])  # in draw order, the first draw's groups where they were
        return Drawn.join([draws[d].group(g, G) for d, g in chosen])

    def _anyone(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank."""
        if not self.rt.distributed:
            return flag
        got = self.rt.all_reduce_mean(torch.tensor(float(flag), device=self.rt.device), over=self.rt.world_size)
        return got.item() > 0

    def _score(self, reward: Reward, records: list[PromptRecord], texts: list[str]) -> list[float | None]:
        G = self.cfg.group_size
        prompts = [r.prompt for r in records for _ in range(G)]
        columns = columns_of(records, G)
        try:
            if self.pool is not None:
                return self.pool.score(reward.spec, reward.option, prompts, texts, columns, self.cfg.reward_timeout_s)
            return call_scorer(reward.fn, reward.spec, prompts, texts, columns, option=reward.option, allow_none=True)
        except TrainbookError as e:  # an incident of this rollout: its rewards are unknown
            self.incidents.append(f"step {self._step()}: {e}")
            return [None] * len(texts)

    def _gather(self, rewards: list[float | None]) -> list[float | None]:
        """Every data-parallel rank's rewards (a tensor-parallel group's copies once)."""
        rows = self.rt.all_gather_floats([math.nan if r is None else r for r in rewards])
        dims = self.rt.dims
        seen, out = set(), []
        for rank, row in enumerate(rows):
            dp = dims.dp_rank(rank) if self.rt.distributed else 0
            if dp not in seen:
                seen.add(dp)
                out += [None if math.isnan(x) else x for x in row]
        return out

    def _micro_batch(self, sequences: list[list[int]], spans: list[tuple[int, int]], advantages: torch.Tensor,
                     total_sequences: int, total_tokens: int) -> RolloutBatch:
        tp = self.rt.dims.tp  # tensor parallelism shards the sequence: its length is a multiple of tp
        width = -(-(max(len(s) for s in sequences) - 1) // tp) * tp
        tokens = torch.full((len(sequences), width + 1), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(sequences), width, dtype=torch.bool)
        for i, (seq, (a, b)) in enumerate(zip(sequences, spans)):
            tokens[i, :len(seq)] = torch.tensor(seq)
            mask[i, a:b] = True
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        weights = rl.token_weights(mask, self.cfg.loss_agg, sequences=total_sequences, tokens=total_tokens,
                                   max_new_tokens=self.cfg.max_new_tokens)
        device = self.rt.device
        old = ref = None
        with torch.no_grad():
            if self.cfg.updates_per_rollout > 1:
                old = rl.token_logprobs(self.policy(inputs.to(device)), targets.to(device)).cpu()
            if self.reference is not None and self.cfg.kl_coef > 0:
                ref = rl.token_logprobs(self.reference(inputs.to(device)), targets.to(device)).cpu()
        return RolloutBatch(inputs, targets, None, None, mask, advantages, weights, old, ref)

    def _figures_of(self, everyone: list[float | None], per_fn: list[list[float | None]], completions) -> dict:
        known = [r for r in everyone if r is not None]
        zero = rl.zero_std_groups(everyone, self.cfg.group_size)
        lengths = self._gather([float(len(c.ids)) for c in completions])
        clipped = self._gather([0.0 if c.stopped else 1.0 for c in completions])
        out = {
            "reward": sum(known) / len(known) if known else math.nan,
            "reward_std": float(torch.tensor(known, dtype=torch.float64).std()) if len(known) > 1 else 0.0,
            "frac_reward_zero_std": sum(zero) / len(zero),
            "completions/mean_length": sum(lengths) / len(lengths),
            "completions/clipped_ratio": sum(clipped) / len(clipped),
        }
        for reward, scores in zip(self.rewards, per_fn):
            mine = self._gather(scores)
            given = [s for s in mine if s is not None]
            out[f"rewards/{reward.name}/mean"] = sum(given) / len(given) if given else math.nan
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    # ---- the loss ---------------------------------------------------------------------------

    def _step(self) -> int:
        """The step being trained (1-based)."""
        return (self.steps_done() if self.steps_done is not None else self.rollout) + 1

    def loss(self, model: nn.Module, batch: RolloutBatch) -> MicroLoss:
        cfg = self.cfg
        if self._sums[0] > 0:  # a kill inside an update, after its first micro-batch's backward
            fault_point("grpo.update", self._step())
        logits = model(batch.inputs)
        logp = rl.token_logprobs(logits, batch.targets)
        old = batch.old_logp if batch.old_logp is not None else logp.detach()
        per_token, low, high = rl.clipped_surrogate(logp, old, batch.advantages.to(logp.device), cfg.clip_low,
                                                    cfg.clip_high)
        kl = None
        if batch.ref_logp is not None:
            kl = rl.k3(logp, batch.ref_logp)
            per_token = per_token + cfg.kl_coef * kl
        with torch.no_grad():
            m = batch.loss_mask
            self._sums += torch.stack([
                m.sum(), (kl * m).sum() if kl is not None else torch.zeros(()),
                (rl.token_entropy(logits) * m).sum(), (low & m).sum(), (high & m).sum(),
            ]).double().cpu()
        return MicroLoss((per_token * batch.weights).sum(), 1 / self.rt.dims.dp)

    def eval_loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        raise TrainbookError("GRPO has no held-out loss: measure held-out reward with `trainbook eval`",
                             where="train.eval_every")

    def finish(self, loss_sum: torch.Tensor, micro_batches: int) -> torch.Tensor:
        return loss_sum * self.rt.dims.dp

    def figures(self) -> dict:
        """The rollout's figures and the step's: mean KL, entropy and clip ratios over the trained
        completion tokens of every rank."""
        rows = self.rt.all_gather_floats(self._sums.tolist())
        tp = self.rt.dims.tp
        total = [sum(r[i] for r in rows) / tp for i in range(5)]
        self._sums.zero_()
        tokens = max(total[0], 1.0)
        step = {"kl": total[1] / tokens, "entropy": total[2] / tokens, "clip_ratio/low_mean": total[3] / tokens,
                "clip_ratio/high_mean": total[4] / tokens}
        if self.cfg.kl_coef == 0:
            del step["kl"]
        times, self._times = self._times, {}  # this rank's, on the step that sampled the rollout
        return {**self._rollout_figures, **step, **{k: round(v, 4) for k, v in times.items()}}
