"""Pruning: plans (which experts to keep), pruned checkpoints, and their verification.

`reap.prune.plan` chooses experts from calibration statistics under a budget and writes a `Plan`;
`reap.prune.write` streams a checkpoint into a pruned one with the kept experts' bytes copied
verbatim; `reap.prune.verify` checks a pruned checkpoint against its source. Pruning works on the
checkpoint store and the family's naming functions only; it never builds the model.
"""
