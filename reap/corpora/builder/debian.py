"""Fetch Debian packages and unpack them without installing: `apt-get download` into a cache
directory, then a pure-Python reader of the .deb (an `ar` archive holding `control.tar.*` and
`data.tar.*`), so extraction needs neither root nor dpkg.
"""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

from reap.errors import ReapError
from reap.fileio import replace_dir
from reap.provenance import sha256_file


def _ar_members(deb: Path) -> dict[str, bytes]:
    """Members of an `ar` archive (the .deb container): name -> bytes."""
    data = deb.read_bytes()
    if not data.startswith(b"!<arch>\n"):
        raise ReapError(f"{deb}: not a Debian package (no ar magic)")
    out, pos = {}, 8
    while pos + 60 <= len(data):
        header = data[pos:pos + 60]
        name = header[:16].decode("ascii", "replace").strip().rstrip("/")
        size = int(header[48:58].decode("ascii").strip())
        out[name] = data[pos + 60:pos + 60 + size]
        pos += 60 + size + (size & 1)
    return out


def _tar(members: dict[str, bytes], stem: str, deb: Path) -> tarfile.TarFile:
    for name, blob in members.items():
        if name.startswith(stem):
            return tarfile.open(fileobj=io.BytesIO(blob), mode="r:*")
    raise ReapError(f"{deb}: no {stem}.* member")


def deb_control(deb: Path) -> dict[str, str]:
    """The control fields of a .deb (Package, Version, ...)."""
    with _tar(_ar_members(deb), "control.tar", deb) as tar:
        for m in tar.getmembers():
            if m.name.lstrip("./") == "control":
                text = tar.extractfile(m).read().decode("utf-8", "replace")
                return dict(re.findall(r"(?m)^([A-Za-z-]+):\s*(.*)$", text))
    raise ReapError(f"{deb}: no control file")


def _no_links(member: tarfile.TarInfo, path: str) -> tarfile.TarInfo | None:
    """Extraction filter: links are skipped (recipes read regular files only), the rest goes
    through tarfile's `data` filter (no absolute paths, nothing outside the destination)."""
    if member.issym() or member.islnk():
        return None
    return tarfile.data_filter(member, path)


def extract_deb(deb: Path, dest: Path) -> Path:
    """Unpack the data of `deb` into `dest` (once: a `.done` marker makes it idempotent)."""
    marker = dest / ".done"
    if marker.exists():
        return dest
    if dest.exists():
        shutil.rmtree(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    with _tar(_ar_members(deb), "data.tar", deb) as tar:
        try:
            tar.extractall(tmp, filter=_no_links)
        except (tarfile.TarError, OSError) as e:
            raise ReapError(f"{deb}: cannot unpack ({e})", exit_code=1) from None
    (tmp / ".done").write_text(sha256_file(deb))
    replace_dir(tmp, dest)
    return dest


def download_deb(package: str, cache: Path, log=print) -> Path:
    """The newest .deb of `package` in `cache`, downloaded with `apt-get download` if absent."""
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob(f"{package}_*.deb"))
    if found:
        return found[-1]
    if shutil.which("apt-get") is None:
        raise ReapError(f"cannot fetch {package}: apt-get not found (put {package}_*.deb in {cache})")
    log(f"  downloading {package} ...")
    proc = subprocess.run(["apt-get", "download", package], cwd=cache, capture_output=True,
                          text=True, timeout=1800, check=False)
    found = sorted(cache.glob(f"{package}_*.deb"))
    if proc.returncode != 0 or not found:
        msg = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise ReapError(f"apt-get download {package} failed: {msg}", exit_code=1)
    return found[-1]


def unpacked(package: str, cache: Path, log=print) -> tuple[Path, dict]:
    """Download and unpack `package`; returns (root dir, {package, version, sha256})."""
    deb = download_deb(package, cache / "debs", log)
    version = deb_control(deb).get("Version", "?")
    root = extract_deb(deb, cache / "unpacked" / deb.stem)
    return root, {"package": package, "version": version, "deb": deb.name,
                  "sha256": (root / ".done").read_text().strip()}
