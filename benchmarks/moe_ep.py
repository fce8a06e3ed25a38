"""Expert parallelism against one process and against plain FSDP on the same ranks, side by side in
one invocation: the tiny MoE recipe (recipes/moe-tiny-shakespeare.toml, without balancing so every
layout computes the same numbers) with the same global batch in each layout; the median step time
and tokens/s (global) after the first step, the ratio to one process, and the final loss.

    .venv/bin/python benchmarks/moe_ep.py [--steps 30] [--cache /tmp/moe-bench-cache]

On a CPU the 2 ranks share the machine's cores (each process one thread): the figure is the cost of
the layout's communication and bookkeeping, not a speed-up.
"""

from __future__ import annotations

from moe_balance import train_each

LAYOUTS = {
    "one process": [],
    "fsdp x 2": ["--nproc", "2"],
    "ep x 2 (fsdp 2)": ["parallel.ep=2", "--nproc", "2"],
    "ep x 2, full AC": ["parallel.ep=2", "train.activation_checkpoint=full", "--nproc", "2"],
}


def main() -> None:
    steps, rows = train_each({name: ["moe.balance=none", *o] for name, o in LAYOUTS.items()}, __doc__, 30)
    base = rows["one process"]["tokens_per_s"]
    print(f"moe-tiny-shakespeare, balance none, {steps} steps x 2,048 tokens; medians after step 1")
    print(f"{'layout':<18} {'step s':>7} {'tokens/s':>9} {'vs one':>7} {'final loss':>11}")
    for name, r in rows.items():
        print(f"{name:<18} {r['step_s']:7.3f} {r['tokens_per_s']:9.0f} {r['tokens_per_s'] / base:7.2f} {r['loss']:11.6f}")


if __name__ == "__main__":
    main()
