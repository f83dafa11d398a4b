"""Benchmarks: `python -m d2f_jax.bench <name>` prints a table and writes JSON under results/."""

BENCHMARKS = ("convert", "decode", "train", "attention", "checkpoint", "cost", "device", "serve", "moe_dispatch")
