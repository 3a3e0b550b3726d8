"""Pruning: plans (which experts to keep), pruned checkpoints, and their verification.

`plan` chooses experts from calibration statistics under a budget (`criteria` scores and combines
them, `budget` sets the per-layer counts) and returns a `Plan` (`plan_file`: the record, its
JSON and `check`, the one validation of a plan); `write` streams a checkpoint into a pruned one
(`tensor_map`: which output tensor comes from where, `stream`: the copy and the expert hashes,
`resume`: the identity of the inputs a half-written output belongs to) with the kept experts'
bytes copied verbatim; `verify` checks a pruned checkpoint against its source; `cli` holds
`reap plan`, `reap prune` and `reap verify`. Pruning works on the checkpoint store and the
family's naming functions only; it never builds the model.
"""
