"""Writing a model directory so that no reader ever sees half of one."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def publish_dir(target: Path, fill: Callable[[Path], None],
                complete: Callable[[Path], bool]) -> Path:
    """Fill a fresh directory beside `target` with `fill(staging)` and rename it into place.
    A concurrent writer that won the race leaves `target` complete (`complete(target)`): that is
    fine; anything else re-raises."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; a model directory is read by other services
    try:
        fill(staging)
        if complete(target):  # a concurrent writer finished first; its readers may be using it
            return target
        if target.exists():  # a leftover that is not complete
            shutil.rmtree(target)
        try:
            os.replace(staging, target)
        except OSError:
            if not complete(target):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
