"""Reproducible studies and benchmarks, each writing into `reports/`: `bench_*.py` scripts
(`python experiments/bench_NAME.py`) and the corpus study package (`python -m
experiments.corpus_study`, from the repository root)."""
