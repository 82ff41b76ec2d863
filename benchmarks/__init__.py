"""Side-by-side benchmarks of fuelline against what it replaces.

    python -m benchmarks [transport|parquet] [--rounds N] [--batches N] [--gb SIZE] [--data-dir DIR]

Each benchmark runs its contenders alternately within one run and reports medians, ranges and
ratios; nothing is asserted. Results go to ``benchmarks/results/<name>.json`` and ``.md``.
"""
