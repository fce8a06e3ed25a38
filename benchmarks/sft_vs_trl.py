"""Supervised fine-tuning side by side with TRL's SFTTrainer (issue 28): the same tiny random
Hugging Face Llama, tokenizer, ChatML template (tests/data/chatml-generation.jinja, whose
{% generation %} markers TRL's assistant_only_loss needs) and conversations on both sides.

  labels      every conversation's token ids and assistant-only labels: trainbook's prepared
              shards (ids + mask bytes) against SFTTrainer's collator output, integer equality
  loss        the masked loss of the same batch before any step (trainbook: pad packing)
  full step   every parameter after one AdamW step over that batch (fp32, constant lr, no
              warmup, no weight decay, clip 1.0, betas 0.9/0.999), at each of --step-lrs: TRL's
              SFT default 2e-5, and 1e-3 (where Adam's first step shows its sensitivity)
  LoRA step   the same with PEFT's LoRA (same rank, alpha, targets); TRL starts from trainbook's
              A matrices (B is zero on both sides), so the adapters start equal
  epoch       tokens/s of one epoch over a larger set (the same real tokens on both sides),
              full and LoRA; trainbook with pad packing (one conversation per row, cut to the batch, as TRL pads)
              and with document packing
  LoRA/full   trainbook's tokens/s and peak memory (the process's high-water RSS, as trainbook
              reports it on CPU) for LoRA against full fine-tuning, one process each; and what
              `trainbook plan` says for llama3-8b on one 80 GiB GPU

The TRL side runs in its own venv (benchmarks/sft_vs_trl_venv.sh makes benchmarks/.venv-trl) as a
subprocess (benchmarks/sft_vs_trl_trl.py); each trainbook epoch runs in its own process too, so
peak memory is its own.

    bash benchmarks/sft_vs_trl_venv.sh          # once
    .venv/bin/python benchmarks/sft_vs_trl.py   # ~2-4 min on 2 busy CPU cores
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from trl_side import TRL_PYTHON, adamw_tail, max_diff, recipe_head, trainer_of
from trainbook.commands.preflight import prepare_data
from trainbook.commands.resolve import resolve
from trainbook.data.chat import TRAINED
from trainbook.data.samples import loss_select, make_batch, num_samples, padding_report
from trainbook.model.hf import to_hf_state_dict
from trainbook.model.lora import to_peft_state_dict
from trainbook.train.objective import masked_loss_sum, trained_tokens

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TEMPLATE = REPO / "tests" / "data" / "chatml-generation.jinja"
OURS_TARGETS = ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj", "up_proj"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


# ---- the shared inputs --------------------------------------------------------------------


def conversations(n: int, seed: int) -> list[dict]:
    """Additions as conversations, one or two turns, of uneven length (a fixed seed)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        a, b = (int(x) for x in rng.integers(1, 10 ** int(rng.integers(1, 5)), 2))
        messages = [{"role": "user", "content": f"What is {a} + {b}?" + " Show your work." * int(rng.integers(0, 3))},
                    {"role": "assistant", "content": f"{a} + {b} = {a + b}."}]
        if rng.random() < 0.3:
            messages += [{"role": "user", "content": "And twice that?"},
                         {"role": "assistant", "content": f"Twice {a + b} is {2 * (a + b)}."}]
        out.append({"messages": messages})
    return out


def write_model(folder: Path, texts: list[str], dim: int, layers: int) -> None:
    """A tiny random LlamaForCausalLM and a byte-level BPE (512 ids, ChatML's specials) trained on
    the conversations, saved by transformers as a Hugging Face folder."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=512, special_tokens=SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>")
    fast.save_pretrained(folder)
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=dim, intermediate_size=3 * dim, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=tok.token_to_id("<|im_end|>"),
        pad_token_id=tok.token_to_id("<|endoftext|>"))
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


def write_recipe(work: Path, name: str, data: Path, args, *, lora: int = 0, packing: str = "pad",
                 steps: int = 1, lr: float | None = None) -> Path:
    recipe = work / f"{name}.toml"
    lora_block = (f'[lora]\nrank = {lora}\nalpha = {args.alpha}\ntargets = {json.dumps(OURS_TARGETS)}\n'
                  if lora else "")
    recipe.write_text(f"""
{recipe_head(work, name, args)}

[tokenizer]
chat_template = "{TEMPLATE}"

[[data.sources]]
name = "chat"
paths = ["{data}"]
format = "chat"

[data]
cache_dir = "{work / 'cache'}"
val_fraction = 0.0
packing = "{packing}"

[data.dedup]
exact = false                    # TRL keeps repeated conversations: the label rows pair up in order

[train]
seq_len = {args.seq_len}
micro_batch_size = {args.batch}
max_steps = {steps}
eval_every = 0
compile = false
loss_on = "assistant"

{adamw_tail(args.lr if lr is None else lr, args.grad_clip)}

{lora_block}""")
    return recipe


# ---- the trainbook side -------------------------------------------------------------------


def trainbook_labels(data) -> list[dict]:
    """Each conversation of the prepared shards as TRL's collator would label it: the template's
    tokens (the EOS prepare appends after each document left out), the token where trained,
    else -100."""
    stream, masks = data.train["chat"], data.train_masks["chat"]
    out = []
    for start, length in zip(*stream.documents()):
        ids = stream.read(int(start), int(start + length))[:-1].astype(np.int64)
        bits = masks.read(int(start), int(start + length))[:-1]
        out.append({"input_ids": ids.tolist(), "labels": np.where(bits & TRAINED, ids, -100).tolist()})
    return out


def trainbook_step(work: Path, args, lora: int, lr: float) -> dict:
    """The first batch's masked loss, the LoRA A matrices at the start, and every parameter after
    one step at learning rate `lr` (Hugging Face / PEFT names)."""
    tag = f"step-{'lora' if lora else 'full'}-{lr:g}"
    recipe = write_recipe(work, tag, work / "step.jsonl", args, lora=lora, lr=lr)
    with trainer_of(recipe, work, tag) as (trainer, data, cfg):
        stream, masks = data.train["chat"], data.train_masks["chat"]
        batch = make_batch(stream, np.arange(args.batch), args.seq_len, None, masks, loss_select("assistant"),
                           pad_id=data.tokenizer.eos_id)
        model = trainer.model
        loss = masked_loss_sum(model, batch) / trained_tokens(batch)
        loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        start = {k: v.detach().clone() for k, v in model.state_dict().items()}
        report = trainer.advance()
        after = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"loss": loss.item(), "grads": grads, "step_loss": report.loss, "lr": report.lr, "start": start,
            "after": after}


def epoch_role(work: Path, args) -> None:
    """In its own process: one epoch of the epoch set; prints a JSON line."""
    packing, lora = args.packing, args.lora
    recipe = write_recipe(work, f"epoch-{packing}-{lora}", work / "epoch.jsonl", args, lora=lora,
                          packing=packing, steps=10_000)
    with trainer_of(recipe, work, f"epoch-{packing}-{lora}") as (trainer, data, cfg):
        steps = max(1, num_samples(data.train["chat"], args.seq_len, packing) // args.batch)  # one epoch
        start = time.perf_counter()
        peak = 0
        for _ in range(steps):
            report = trainer.advance()
            peak = max(peak, report.mem_peak_bytes or 0)
        seconds = time.perf_counter() - start
        waste = padding_report([data.train["chat"]], args.seq_len).waste if packing == "pad" else None
    print(json.dumps({"seconds": seconds, "steps": steps, "mem_peak_bytes": peak, "waste": waste,
                      "trainable": trainer.trainable}))


def run_epoch(work: Path, args, packing: str, lora: int) -> dict:
    done = subprocess.run([sys.executable, __file__, "--role", "epoch", "--work", str(work), "--packing", packing,
                           "--lora", str(lora), *passthrough(args)], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"trainbook epoch ({packing}, lora {lora}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def passthrough(args) -> list[str]:
    return ["--batch", str(args.batch), "--seq-len", str(args.seq_len), "--lr", str(args.lr), "--rank",
            str(args.rank), "--alpha", str(args.alpha), "--threads", str(args.threads), "--grad-clip",
            str(args.grad_clip)]


def plan_totals() -> dict[str, tuple[float, bool]]:
    """`trainbook plan` of llama3-8b on one 80 GiB rank, full and LoRA rank 16: (GiB, fits)."""
    out = {}
    for name, extra in (("full", []), ("lora r16", ["lora.rank=16"])):
        cmd = [sys.executable, "-m", "trainbook", "plan", str(REPO / "recipes" / "llama3-8b.toml"), *extra,
               "--world-size", "1", "--device-memory", "80GiB", "--json"]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if done.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        memory = json.loads(done.stdout)["memory"]
        out[name] = (memory["largest"]["total"] / 2**30, bool(memory["fits"]))
    return out


# ---- comparing ----------------------------------------------------------------------------


def after_one_step(work: Path, lr: float, full: dict, lora: dict, ours_grads: dict) -> list[tuple]:
    """Table rows: every parameter (full) and every adapter (LoRA) after one step at `lr`, against
    TRL's. Adam's first step moves a weight by lr * g / (|g| + eps): where |g| is small, the last
    bits of g, which two implementations sum in different orders, decide a visible fraction of lr.
    The rows say how large the gradient is wherever the parameters differ by more than 1e-6."""
    theirs_full = torch.load(work / "trl" / f"full-{lr:g}.pt")
    ours_after = to_hf_state_dict(full["after"], tied=False)
    full_diff = max_diff(ours_after, theirs_full)
    over = [(k, (ours_after[k] - theirs_full[k]).abs() > 1e-6) for k in ours_after]
    n_over = sum(int(m.sum()) for _, m in over)
    n_all = sum(m.numel() for _, m in over)
    g_over = max((ours_grads[k][m].abs().max().item() for k, m in over if m.any()), default=0.0)
    where = f", all with |g| <= {g_over:.1e} (eps 1e-8)" if n_over else ""
    theirs_lora = {k.replace(".default.", "."): v for k, v in torch.load(work / "trl" / f"lora-{lr:g}.pt").items()}
    adapters = to_peft_state_dict(lora["after"])
    lora_diff = max_diff(adapters, theirs_lora)
    lora_over = sum(int(((adapters[k] - theirs_lora[k]).abs() > 1e-6).sum()) for k in adapters)
    lora_all = sum(v.numel() for v in adapters.values())
    base_unchanged = all(torch.equal(lora["after"][k], lora["start"][k]) for k in lora["start"]
                         if ".lora_" not in k)
    return [
        (f"full, lr {lr:g}: params after 1 step, max |diff|", f"{full_diff[0]:.2e}",
         f"{n_over} of {n_all:,} weights over 1e-6{where}; max |diff| / lr {full_diff[0] / lr:.1e}", "< 1e-6"),
        (f"LoRA, lr {lr:g}: adapters after 1 step, max |diff|", f"{lora_diff[0]:.2e}",
         f"{lora_over} of {lora_all:,} over 1e-6; max |diff| / lr {lora_diff[0] / lr:.1e}; base bitwise "
         f"unchanged: {base_unchanged}", "< 1e-6"),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", default="main", choices=["main", "epoch"])
    parser.add_argument("--work", type=Path, default=None, help="working folder (default: a temporary one)")
    parser.add_argument("--conversations", type=int, default=512, help="conversations in the timed epoch")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=160, help="above the longest conversation: nothing is cut")
    parser.add_argument("--lr", type=float, default=1e-3, help="the epochs' learning rate")
    parser.add_argument("--step-lrs", default="2e-5,1e-3",
                        help="learning rates of the one-step comparison (2e-5: TRL's SFT default)")
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--packing", default="pad")
    parser.add_argument("--lora", type=int, default=0)
    parser.add_argument("--trl-python", type=Path, default=TRL_PYTHON)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.role == "epoch":
        epoch_role(args.work, args)
        return 0
    if not args.trl_python.exists():
        raise SystemExit(f"{args.trl_python} not found: run `bash benchmarks/sft_vs_trl_venv.sh` first")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        return compare(work, args)


def compare(work: Path, args) -> int:
    epoch_set = conversations(args.conversations, seed=0)
    step_set = epoch_set[: args.batch]
    for name, records in (("epoch", epoch_set), ("step", step_set)):
        (work / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    write_model(work / "model", [m["content"] for r in epoch_set for m in r["messages"]], args.dim, args.layers)
    print(f"model: LlamaForCausalLM dim {args.dim}, {args.layers} layers, vocab 512; {len(epoch_set)} "
          f"conversations, batch {args.batch}, seq_len {args.seq_len}, lr {args.lr}, {args.threads} threads",
          flush=True)

    # trainbook first: its LoRA A matrices are TRL's starting point (the same at every lr: seed 0).
    step_lrs = [float(x) for x in args.step_lrs.split(",")]
    steps = {(lr, r): trainbook_step(work, args, r, lr) for lr in step_lrs for r in (args.rank, 0)}
    start_a = to_peft_state_dict(steps[(step_lrs[0], args.rank)]["start"])
    import safetensors.torch
    safetensors.torch.save_file({k: v.contiguous() for k, v in start_a.items()}, work / "lora_a0.safetensors")
    full = steps[(step_lrs[0], 0)]

    spec = {"model": str(work / "model"), "template": str(TEMPLATE), "step_data": str(work / "step.jsonl"),
            "epoch_data": str(work / "epoch.jsonl"), "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr,
            "grad_clip": args.grad_clip, "rank": args.rank, "alpha": args.alpha, "lora_targets": PEFT_TARGETS,
            "lora_a0": str(work / "lora_a0.safetensors"), "threads": args.threads,
            "step_lrs": step_lrs}
    (work / "spec.json").write_text(json.dumps(spec))
    print("TRL side (its own venv) ...", flush=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run([str(args.trl_python), str(HERE / "sft_vs_trl_trl.py"), str(work / "spec.json"),
                           str(work / "trl")], capture_output=True, text=True, env={**env, "HF_HUB_OFFLINE": "1"})
    if done.returncode:
        raise SystemExit(f"the TRL side failed:\n{done.stderr[-4000:]}")
    trl_out = json.loads((work / "trl" / "result.json").read_text())

    print("trainbook epochs (one process each) ...", flush=True)
    epochs = {(p, r): run_epoch(work, args, p, r) for p, r in (("pad", 0), ("pad", args.rank), ("document", 0))}
    plan = plan_totals()

    # Labels: trainbook's prepared epoch set against TRL's collator, conversation by conversation.
    res = resolve(write_recipe(work, "labels", work / "epoch.jsonl", args), [], world_size=1)
    with contextlib.redirect_stdout(open(os.devnull, "w")):
        ours_labels = trainbook_labels(prepare_data(res, log=print))
    theirs_labels = json.loads((work / "trl" / "labels.json").read_text())
    same_ids = sum(a["input_ids"] == b["input_ids"] for a, b in zip(ours_labels, theirs_labels))
    same_labels = sum(a["labels"] == b["labels"] for a, b in zip(ours_labels, theirs_labels))
    trained = sum(sum(x != -100 for x in a["labels"]) for a in theirs_labels)
    tokens = sum(len(a["input_ids"]) for a in theirs_labels)
    longest = max(len(a["input_ids"]) for a in ours_labels)
    if longest + 1 > args.seq_len + 1:  # TRL cuts at max_length, trainbook at seq_len + 1 (with its EOS)
        print(f"note: the longest conversation has {longest} tokens; with --seq-len {args.seq_len} both sides cut "
              "it (differently): raise --seq-len to compare exactly")

    ours_grads = to_hf_state_dict(full["grads"], tied=False)
    grad_diff = max_diff(ours_grads, torch.load(work / "trl" / "grads.pt"))
    grad_max = max(g.abs().max().item() for g in ours_grads.values())
    step_rows = [row for lr in step_lrs
                 for row in after_one_step(work, lr, steps[(lr, 0)], steps[(lr, args.rank)], ours_grads)]

    tb, tb_lora, tb_doc = epochs[("pad", 0)], epochs[("pad", args.rank)], epochs[("document", 0)]
    rate = lambda s: tokens / s  # noqa: E731  the same real tokens on every side
    rows = [
        ("labels: input_ids equal (conversations)", f"{same_ids}/{len(theirs_labels)}",
         f"{len(ours_labels)} on trainbook's side; longest {longest} tokens", "integer equality"),
        ("labels: assistant-only labels equal", f"{same_labels}/{len(theirs_labels)}",
         f"{trained} trained of {tokens} tokens", "integer equality"),
        ("masked loss, same batch (before a step)", f"{abs(full['loss'] - trl_out['loss']):.2e}",
         f"trainbook {full['loss']:.8f} / TRL {trl_out['loss']:.8f}", "< 1e-6"),
        ("full: gradients of that loss, max |diff|", f"{grad_diff[0]:.2e}",
         f"{grad_diff[2]} tensors; largest |g| {grad_max:.1e}", "-"),
        *step_rows,
        ("epoch tokens/s, full: trainbook pad / TRL", f"{trl_out['full_epoch_s'] / tb['seconds']:.2f}x",
         f"{rate(tb['seconds']):,.0f} vs {rate(trl_out['full_epoch_s']):,.0f} tok/s; "
         f"{tb['steps']} vs {trl_out['full_epoch_steps']} steps; pad waste {tb['waste']:.1%}", ">= 1"),
        ("epoch tokens/s, full: trainbook document / TRL", f"{trl_out['full_epoch_s'] / tb_doc['seconds']:.2f}x",
         f"{rate(tb_doc['seconds']):,.0f} tok/s; {tb_doc['steps']} steps (packed windows)", ">= 1"),
        ("epoch tokens/s, LoRA: trainbook pad / TRL", f"{trl_out['lora_epoch_s'] / tb_lora['seconds']:.2f}x",
         f"{rate(tb_lora['seconds']):,.0f} vs {rate(trl_out['lora_epoch_s']):,.0f} tok/s", ">= 1"),
        ("trainbook LoRA / full: tokens/s", f"{tb['seconds'] / tb_lora['seconds']:.2f}x",
         f"{rate(tb_lora['seconds']):,.0f} vs {rate(tb['seconds']):,.0f} tok/s (this CPU)", "torchtune: 1.9x"),
        ("trainbook LoRA / full: peak memory (RSS)", f"{tb_lora['mem_peak_bytes'] / tb['mem_peak_bytes']:.2f}x",
         f"{tb_lora['mem_peak_bytes'] / 2**20:,.0f} vs {tb['mem_peak_bytes'] / 2**20:,.0f} MiB", "torchtune: 0.85x"),
        ("plan llama3-8b, 1 x 80 GiB: LoRA r16 / full", f"{plan['lora r16'][0] / plan['full'][0]:.2f}x",
         f"LoRA {plan['lora r16'][0]:.1f} GiB ({'fits' if plan['lora r16'][1] else 'does not fit'}), "
         f"full {plan['full'][0]:.1f} GiB ({'fits' if plan['full'][1] else 'does not fit'})", "-"),
    ]
    print(f"\ntrainbook vs TRL {trl_out['versions']['trl']} (peft {trl_out['versions']['peft']}, transformers "
          f"{trl_out['versions']['transformers']}, torch {trl_out['versions']['torch']}), CPU, fp32\n")
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    header = ("quantity", "value", "detail", "target")
    widths = [max(w, len(h)) for w, h in zip(widths, header)]
    for row in (header, tuple("-" * w for w in widths), *rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    print(f"\nstep loss as each trainer reported it: trainbook {full['step_loss']:.6f} (lr {full['lr']:g}), "
          f"TRL {trl_out['full_step_loss']:.6f}; TRL pads each batch to its longest row, trainbook's pad packing "
          f"cuts it after its last trained target (a multiple of 8, at most seq_len {args.seq_len})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
