"""Test setup: deterministic, single-threaded torch (the CI machine is shared; 2 threads can be
slower than 1 under load) and a tmp working directory per test."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)
torch.manual_seed(0)
