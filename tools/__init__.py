"""Build steps of what the repository ships (not studies): `train_k3mini` trains the bundled
k3-mini model and `export_k3mini` writes it to `reap/models/k3mini`. Run from the repository root:

    python -m tools.train_k3mini --run DIR
    python -m tools.export_k3mini --run DIR --out reap/models/k3mini
"""
