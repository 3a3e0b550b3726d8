"""Calibration: stream corpora through a model and record per-expert routing statistics.

`calibrate(...)` (in `reap.calibrate.runner`) runs layer-major and expert-major over a checkpoint
store, writes one `reap.stats.ExpertStats` file per corpus of the mixture plus their merge, and
resumes per layer after a crash; `reap calibrate` is its command line (`reap.calibrate.cli`).
"""
