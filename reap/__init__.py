"""reap: prune the experts of Mixture-of-Experts language models.

Data flows one way: corpora -> calibrate -> analyze -> prune -> engine -> eval. Shared below every
stage: the checkpoint store (`reap.checkpoint`), the quantization codecs (`reap.quant`) and the
model families (`reap.models`). Importing the package has no side effects.
"""

__version__ = "0.1.0"
