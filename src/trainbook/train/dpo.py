"""DPO on the objective seam (train/objective.py): preference pairs, and the pairwise loss of the
policy's log-probabilities against a reference's.

A pair is a prompt with a chosen and a rejected completion, each encoded as fine-tuning encodes a
`prompt_completion` record (data/chat.py): the same ids, and the completion's tokens (its
end-of-turn or EOS included) the only ones whose log-probabilities are summed. Step k trains the
pairs `StepCycle` gives it (a pure function of k, so a resumed run trains the pairs an unbroken
one did); a micro-batch holds `micro_batch_size` pairs as 2 x that many rows, the chosen
completions first, right-padded to a multiple of the tensor-parallel degree.

The reference's log-probability sums come with each micro-batch: from a frozen whole copy of the
starting model (`frozen`), from that copy's one pass over every pair at start-up (`precompute`,
after which it is freed), or from the policy with its LoRA adapters switched off
(`adapter_off`). The loss of a micro-batch is the sum of its pairs' losses over the step's pair
count / dp, so micro-batches and ranks add up to the mean over the step's pairs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from torch import nn

from trainbook.config.dpo import DpoConfig
from trainbook.data.chat import TRAINED, chat_encoder
from trainbook.data.samples import Batch
from trainbook.data.sources import preference_records
from trainbook.data.tokenizer import Tokenizer
from trainbook.errors import TrainbookError
from trainbook.faults import fault_point
from trainbook.model.lora import LoRALinear
from trainbook.parallel.runtime import Runtime
from trainbook.train import rl
from trainbook.train.grpo import StepCycle
from trainbook.train.objective import MicroLoss

PRECOMPUTE_BATCH = 64  # pairs a forward while the reference scores every pair at start-up


class Side(NamedTuple):
    ids: list[int]  # prompt + completion + EOS
    trained: list[bool]  # per target (ids[1:]): a completion token whose log-probability counts


class Pair(NamedTuple):
    chosen: Side
    rejected: Side
    where: str  # "'FILE' line N"


class PairBatch(NamedTuple):
    """A micro-batch of pairs: `Batch`'s fields (the chosen rows, then the rejected rows) and the
    reference's log-probability sum of each row."""

    inputs: torch.Tensor  # (2P, T)
    targets: torch.Tensor  # (2P, T)
    positions: torch.Tensor | None
    sources: torch.Tensor | None
    loss_mask: torch.Tensor  # (2P, T) bool: the completions' targets
    ref_logp: torch.Tensor  # (2P,)


def dpo_inputs(cfg, tokenizer: Tokenizer) -> list[Pair]:
    """The pairs of the recipe's `preference` sources as the model reads them; a pair whose
    longer side does not fit train.seq_len is one line naming its file and line."""
    encoder = chat_encoder(cfg.data, cfg.tokenizer, tokenizer)
    seq_len = cfg.train.seq_len
    pairs = []
    for i, source in enumerate(cfg.data.sources):
        where = f"data.sources[{i}]"
        for record in preference_records(source, where):
            sides = []
            for name, document in (("chosen", record.chosen), ("rejected", record.rejected)):
                ids, bits = encoder.encode(document, where)
                if len(ids) - 1 > seq_len:
                    raise TrainbookError(f"{record.where}: the prompt with its {name} completion is {len(ids)} "
                                         f"tokens, more than train.seq_len + 1 = {seq_len + 1}", where=where)
                sides.append(Side(ids.tolist(), ((bits[1:] & TRAINED) > 0).tolist()))
            pairs.append(Pair(*sides, record.where))
    if not pairs:
        raise TrainbookError("the preference sources hold no pair", where="data.sources")
    return pairs


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """The model without its LoRA adapters (each scale 0) and in eval mode, for the block."""
    adapted = [m for m in model.modules() if isinstance(m, LoRALinear)]
    scales = [m.scale for m in adapted]
    was_training = model.training
    model.eval()
    for m in adapted:
        m.scale = 0.0
    try:
        yield model
    finally:
        for m, s in zip(adapted, scales):
            m.scale = s
        model.train(was_training)


class DpoObjective:
    def __init__(self, cfg: DpoConfig, pairs: list[Pair], rt: Runtime, *, micro_batch_size: int, pad_id: int,
                 seed: int, policy: nn.Module, reference: nn.Module | None = None,
                 steps_done: Callable[[], int] | None = None):
        self.cfg, self.pairs, self.rt, self.policy = cfg, pairs, rt, policy
        self.micro_batch_size, self.pad_id = micro_batch_size, pad_id
        self.cycle = StepCycle(range(len(pairs)), cfg.pairs_per_step, seed, rt.dp_rank, rt.dims.dp,
                               where="dpo.pairs_per_step")
        self.divisor = cfg.pairs_per_step / rt.dims.dp
        self.steps_done = steps_done
        self.step = 0
        self.reference = reference
        self.precomputed: torch.Tensor | None = None
        if cfg.reference == "precompute":
            if reference is None:
                raise ValueError("reference 'precompute' needs the reference model to score the pairs with")
            self.precomputed = self._precompute(reference)
            self.reference = None  # freed once every pair is scored
        elif cfg.reference == "frozen" and reference is None:
            raise ValueError("reference 'frozen' needs the reference model")
        self._sums = torch.zeros(7, dtype=torch.float64)  # pairs, loss, chosen, rejected, right, logp c, logp r

    def _precompute(self, reference: nn.Module) -> torch.Tensor:
        """(pairs, 2): the reference's log-probability sums of every pair's chosen and rejected
        completion, in the order of `pairs`."""
        out = []
        for lo in range(0, len(self.pairs), PRECOMPUTE_BATCH):
            batch = self._rows([self.pairs[i] for i in range(lo, min(lo + PRECOMPUTE_BATCH, len(self.pairs)))])
            sums = self._reference_sums(reference, *batch)
            half = len(sums) // 2
            out.append(torch.stack([sums[:half], sums[half:]], dim=1))
        return torch.cat(out)

    # ---- the producer ----------------------------------------------------------------------

    def produce(self, batches: Iterator[Batch]) -> Iterator[PairBatch]:
        while True:
            if self.steps_done is not None:
                self.step = self.steps_done()
            chosen = self.cycle.take(self.step)
            for lo in range(0, len(chosen), self.micro_batch_size):
                yield self._micro_batch(chosen[lo:lo + self.micro_batch_size])
            self.step += 1

    def _rows(self, pairs: list[Pair]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """inputs, targets, mask of the chosen rows then the rejected rows, right-padded to a
        multiple of tp (tensor parallelism shards the sequence)."""
        sides = [p.chosen for p in pairs] + [p.rejected for p in pairs]
        tp = self.rt.dims.tp
        width = -(-max(len(s.ids) - 1 for s in sides) // tp) * tp
        tokens = torch.full((len(sides), width + 1), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(sides), width, dtype=torch.bool)
        for i, s in enumerate(sides):
            tokens[i, :len(s.ids)] = torch.tensor(s.ids)
            mask[i, :len(s.trained)] = torch.tensor(s.trained)
        return tokens[:, :-1], tokens[:, 1:], mask

    @torch.no_grad()
    def _reference_sums(self, reference: nn.Module, inputs, targets, mask) -> torch.Tensor:
        device = self.rt.device
        return rl.sequence_logprobs(reference(inputs.to(device)), targets.to(device), mask.to(device)).cpu()

    def _micro_batch(self, indices: list[int]) -> PairBatch:
        inputs, targets, mask = self._rows([self.pairs[i] for i in indices])
        if self.precomputed is not None:
            got = self.precomputed[indices]
            ref = torch.cat([got[:, 0], got[:, 1]])
        elif self.cfg.reference == "adapter_off":
            with adapters_off(self.policy) as base:
                ref = self._reference_sums(base, inputs, targets, mask)
        else:
            ref = self._reference_sums(self.reference, inputs, targets, mask)
        return PairBatch(inputs, targets, None, None, mask, ref)

    # ---- the loss ---------------------------------------------------------------------------

    def loss(self, model: nn.Module, batch: PairBatch) -> MicroLoss:
        if self._sums[0] > 0:  # a kill inside a step, after its first micro-batch's backward
            fault_point("dpo.update", self.step + 1)
        sums = rl.sequence_logprobs(model(batch.inputs), batch.targets, batch.loss_mask)
        half = sums.shape[0] // 2
        ref = batch.ref_logp.to(sums.device)
        loss, chosen, rejected = rl.dpo_loss(sums[:half], sums[half:], ref[:half], ref[half:], self.cfg.beta,
                                             self.cfg.label_smoothing)
        with torch.no_grad():
            self._sums += torch.stack([
                torch.tensor(float(half)), loss.sum(), chosen.sum(), rejected.sum(), (chosen > rejected).sum(),
                sums[:half].sum(), sums[half:].sum(),
            ]).double().cpu()
        return MicroLoss(loss.sum(), self.divisor)

    def eval_loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        raise TrainbookError("DPO has no held-out loss here: measure the held-out reward with `trainbook eval`",
                             where="train.eval_every")

    def finish(self, loss_sum: torch.Tensor, micro_batches: int) -> torch.Tensor:
        return loss_sum / self.divisor

    def figures(self) -> dict:
        """TRL's names: the mean implicit rewards beta (logp - ref) of the chosen and rejected
        completions, their margin, the share of pairs ranked right, the mean log-prob sums."""
        rows = self.rt.all_gather_floats(self._sums.tolist())
        tp = self.rt.dims.tp
        n, _, chosen, rejected, right, logp_c, logp_r = (sum(r[i] for r in rows) / tp for i in range(7))
        self._sums.zero_()
        n = max(n, 1.0)
        return {"rewards/chosen": chosen / n, "rewards/rejected": rejected / n, "rewards/margins": (chosen - rejected) / n,
                "rewards/accuracies": right / n, "logps/chosen": logp_c / n, "logps/rejected": logp_r / n}
