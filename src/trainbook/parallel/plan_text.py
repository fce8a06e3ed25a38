"""`trainbook plan`'s text: the plan (plain data from `parallel.plan.make_plan`) as a report."""

from __future__ import annotations

import re

from trainbook.sizes import human


def render(plan: dict) -> str:
    """The plan for people: mesh, stages, placements, batch, gradient path, memory, verdict."""
    m, mesh, b = plan["model"], plan["mesh"], plan["batch"]
    sizes = mesh["sizes"]
    options = "".join(f", {text}" for key, text in (("qkv_bias", "q/k/v biases"), ("qk_norm", "q/k norms"),
                                                    ("tie_embeddings", "tied embeddings")) if m[key])
    lines = [f"plan: {plan['recipe'] or 'recipe'} on {plan['world_size']} rank(s)",
             f"model {m['name']}: {m['params']:,} parameters ({m['family']}, {m['n_layers']} layers, dim {m['dim']}, "
             f"{m['n_heads']} heads / {m['n_kv_heads']} kv heads of {m['head_dim']}, ffn {m['ffn_dim']}, "
             f"vocab {m['vocab_size']}{options}); weights fp32, compute {plan['precision']['compute']}", ""]
    if "n_experts" in m:
        lines[-1:-1] = [f"mixture of experts: {m['n_experts']} routed experts, {m['experts_per_token']} per token, "
                        f"{m['experts_per_rank']} held per rank; {m['active_params']:,} parameters active per token "
                        "(what MFU counts)"]
    if plan.get("lora"):
        lora = plan["lora"]
        lines[-1:-1] = [f"LoRA rank {lora['rank']}, alpha {lora['alpha']:g}: {lora['trainable_params']:,} adapter "
                        "parameters train; the base is frozen (its weights held, no gradients, no optimizer state)"]

    shown = {k: v for k, v in sizes.items() if k not in ("ep", "efsdp") and (k != "cp" or v > 1)}
    layout = " x ".join(f"{k} {v}" + (f" (= efsdp {sizes['efsdp']} x ep {sizes['ep']})" if k == "dp_shard" and
                                       "ep" in sizes else "") for k, v in shown.items())
    lines += [f"Mesh: {layout} (rank = row-major over {', '.join(shown)}; tp innermost)"]
    for name, role in mesh["roles"].items():
        lines.append(f"  {name:<13}{sizes[name]:>4}  {role}: {_groups(mesh['groups'][name])}")
    if not mesh["roles"]:
        lines.append("  one rank: no communication")
    lines.append(f"  same data (one data-parallel rank each): {_groups(mesh['same_data'])}")
    lines.append("")

    pipe = plan["pipeline"]
    if pipe is None:
        lines += [f"Pipeline: none (pp = 1); every rank runs all {m['n_layers']} blocks", ""]
    else:
        lines.append(f"Pipeline: {len(pipe['stages'])} stages ({pipe['split']} split), {pipe['schedule']}, "
                     f"{pipe['microbatches']} micro-batches per pass; stage i on pp rank i % {sizes['pp']}")
        for s in pipe["stages"]:
            lo, hi = s["layers"][0], s["layers"][1] - 1
            parts = (["embedding"] if s["embedding"] else []) + [f"layers {lo}-{hi}" if hi > lo else f"layer {lo}"] \
                + (["norm + head"] if s["head"] else [])
            lines.append(f"  stage {s['stage']}: {', '.join(parts):<38} {s['params']:>14,} params  "
                         f"ranks {_groups([s['ranks']])}")
        lines.append("")

    lines += _param_lines(plan["params"]) + [""]

    lines += ["Batch (per optimizer step)",
              f"  {b['global_batch_tokens']:,} tokens = {b['global_samples']:,} samples of {b['seq_len']} "
              f"= {b['accum_steps']} accumulation step(s) x {b['micro_batch_size']} samples per micro-batch x "
              f"{b['data_parallel_ranks']} data-parallel rank(s)",
              f"  each rank: {b['samples_per_rank']:,} samples ({b['tokens_per_rank']:,} tokens) per step, "
              f"{b['micro_batch_size']} per forward/backward pass; tp and pp ranks of one data-parallel rank "
              "read the same samples" + (f", and its {b['cp']} cp ranks hold 1/{b['cp']} of each sequence's "
                                         f"tokens ({b['seq_len'] // b['cp']})" if b.get("cp", 1) > 1 else "")]
    if "pp_microbatches" in b:
        lines.append(f"  the pipeline cuts each micro-batch into {b['pp_microbatches']} chunks of "
                     f"{b['pp_microbatch_samples']} sample(s)")
    lines += ["", "Gradient path (per optimizer step)"]
    lines += [f"  {g['dim']:<13}{g['text']}" for g in plan["gradient_path"]] or ["  one rank: none"]
    if plan["gradient_remedies"]:  # what this layout could send instead (doctor names them too)
        lines += ["  fewer data-parallel bytes:", *(f"    {r}" for r in plan["gradient_remedies"])]
    lines += [""] + _memory_lines(plan["memory"])
    return "\n".join(lines)


def _groups(groups: list[list[int]], limit: int = 4) -> str:
    shown = " ".join(_span(g) for g in groups[:limit])
    return shown + (f" ... ({len(groups)} groups)" if len(groups) > limit else "")


def _span(ranks: list[int]) -> str:
    """[0-7], [0, 8, ... 120] (a stride), [0, 1, 2, 3, ... 391 (32 ranks)], or the list itself."""
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"[{ranks[0]}-{ranks[-1]}]"
    if len(ranks) > 4 and ranks == list(range(ranks[0], ranks[-1] + 1, ranks[1] - ranks[0])):
        return f"[{ranks[0]}, {ranks[1]}, ... {ranks[-1]}]"
    if len(ranks) > 8:
        return "[" + ", ".join(map(str, ranks[:4])) + f", ... {ranks[-1]} ({len(ranks)} ranks)]"
    return "[" + ", ".join(map(str, ranks)) + "]"


def _param_lines(params: list[dict]) -> list[str]:
    """Blocks collapsed: `layers.*.x` once per distinct placement, with how many blocks have it."""
    rows: dict[tuple, list] = {}
    for p in params:
        key_name = re.sub(r"^layers\.\d+\.", "layers.*.", p["name"])
        placement = ", ".join(f"{k} {v}" for k, v in p["placements"].items() if k != "pp") or "whole"
        key = (key_name, tuple(p["shape"]), placement, tuple(p["local_shape"]), tuple(p["largest_local_shape"]))
        row = rows.setdefault(key, [0, []])
        row[0] += 1
        row[1] += [p["first_rank"]] if p["first_rank"] not in row[1] else []
    pp = any("pp" in p["placements"] for p in params)
    lines = ["Parameters: placement per mesh dimension, local shard on the first rank holding it (and the "
             "largest, where ranks differ)" + ("; each lives only on its stage's pp rank" if pp else "")]
    for (name, shape, placement, local, largest), (count, first) in rows.items():
        label = f"{name} (x{count})" if count > 1 else name
        where = f"rank {first[0]}" if len(first) == 1 else f"ranks {'/'.join(map(str, first))}"
        other = f" (largest {_shape(largest)})" if largest != local else ""
        lines.append(f"  {label:<38}{_shape(shape):>14}  {placement:<38}{where}: {_shape(local)}{other}")
    return lines


def _shape(shape) -> str:
    return " x ".join(map(str, shape)) or "scalar"


def _memory_lines(mem: dict) -> list[str]:
    """One row per set of ranks holding the same amounts (ranks with equal numbers collapsed)."""
    mode = mem["activation_checkpoint"]
    groups: dict[tuple, list[int]] = {}
    for r in mem["per_rank"]:
        key = (r["params"], r["grads"], r["optimizer"], r["transient"], r["total"],
               tuple(r["activations"][k]["peak"] for k in ("none", "full", "selective")))
        groups.setdefault(key, []).append(r["rank"])
    width = max(len("ranks"), *(len(_span(ranks)) for ranks in groups.values())) + 2
    lines = [f"Memory per rank (exact: parameters, gradients, AdamW states; estimated: activations at the "
             f"configured activation_checkpoint = {mode}, communication buffers)",
             f"  {'ranks':<{width}}{'params':>10}{'grads':>10}{'optimizer':>11}{'activations':>13}"
             f"{'buffers':>10}{'total':>10}   activations none / full / selective (peak)"]
    for (params, grads, optim, transient, total, acts), ranks in groups.items():
        act = acts[("none", "full", "selective").index(mode)]
        lines.append(f"  {_span(ranks):<{width}}{human(params):>10}{human(grads):>10}{human(optim):>11}"
                     f"{human(act):>13}{human(transient):>10}{human(total):>10}   "
                     + " / ".join(human(a) for a in acts))
    first = mem["per_rank"][0]
    if first.get("reference") or first.get("kv_cache"):
        lines.append(f"  and on every rank: {human(first['reference'])} for the frozen reference model, "
                     f"{human(first['kv_cache'])} for the rollout's KV cache (while sampling, not in backward: the "
                     "total counts the larger of it and the activations)")
    if mem["ranks_covered"] < mem["world_size"]:
        lines.append(f"  ({mem['ranks_covered']} of {mem['world_size']} ranks: the first and last dp_shard and tp "
                     "index of each pipeline rank; the first holds the largest shards)")
    if mem.get("context"):
        lines += ["", *_context_lines(mem["context"])]
    if mem["device_memory"] is not None:
        lines += ["", mem["verdict"]]
    return lines


def _context_lines(table: dict) -> list[str]:
    """Activations per rank against sequence length (rows) and cp (columns); the recipe's cell
    in brackets."""
    lines = [f"Activations per rank against sequence length and cp (peak at activation_checkpoint = "
             f"{table['activation_checkpoint']}, {table['microbatch_samples']} sequence(s) a micro-batch; "
             "each rank keeps seq_len / cp tokens and the gathered keys and values)",
             f"  {'seq_len':>9}" + "".join(f"{'cp ' + str(cp):>12}" for cp in table["cp"])]
    for row in table["rows"]:
        cells = []
        for cp, peak in zip(table["cp"], row["peak"]):
            text = "-" if peak is None else human(peak)
            if row["seq_len"] == table["seq_len"] and cp == table["recipe_cp"]:
                text = f"[{text}]"
            cells.append(f"{text:>12}")
        lines.append(f"  {row['seq_len']:>9,}" + "".join(cells))
    return lines

