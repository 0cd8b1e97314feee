"""Model directories confined to the roots their registrant may use.

The operator registers from `SLINFER_MODEL_ROOTS` (anywhere when unset); tenant T only from
`SLINFER_TENANT_MODELS_DIR/T`. A path is checked after following its symlinks, and so is every
symlink inside the directory, so neither the directory nor a file in it (a `config.json`, the
weights) can lead a node or the gateway's tokenizer outside the roots. Containment is checked
before existence, so a refused path says nothing about what exists outside the roots.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from services.gateway import errors

MAX_PATH_CHARS = 4096
MAX_ENTRIES = 10_000  # a model directory has tens of files; this bounds the walk


def confined_model_dir(raw: str, roots: Sequence[Path] | None) -> Path:
    """The real (symlink-free) path of the model directory `raw`, if it lies inside `roots`
    (None: anywhere). Raises APIError: 400 for a malformed path, 403 outside the roots."""
    if not raw or len(raw) > MAX_PATH_CHARS or "\0" in raw:
        raise errors.invalid_request(f"path must be 1 to {MAX_PATH_CHARS} characters without NUL.",
                                     param="path", code="invalid_value")
    try:
        real = Path(raw).expanduser().resolve()  # strict=False: no answer depends on existence yet
    except (OSError, RuntimeError, ValueError):  # a symlink loop, an unreadable component
        if roots is None:
            raise errors.invalid_request("path cannot be resolved.", param="path",
                                         code="invalid_model_dir") from None
        raise _outside() from None
    if roots is None:
        return real
    if not any(real.is_relative_to(root) for root in roots):
        raise _outside()
    if real.is_dir():
        _check_links_inside(real, roots)
    return real


def _check_links_inside(directory: Path, roots: Sequence[Path]) -> None:
    seen = 0
    for parent, dirs, files in os.walk(directory):  # does not descend into linked directories
        for name in (*dirs, *files):
            seen += 1
            if seen > MAX_ENTRIES:
                raise errors.invalid_request(f"The model directory has more than {MAX_ENTRIES} "
                                             "entries.", param="path", code="invalid_model_dir")
            entry = Path(parent, name)
            if entry.is_symlink() and not _inside(entry, roots):
                raise errors.APIError(403, f"{str(entry.relative_to(directory))!r} in the model "
                                      "directory links outside the directories you may register "
                                      "models from.", type="permission_error", param="path",
                                      code="path_not_allowed")


def _inside(link: Path, roots: Sequence[Path]) -> bool:
    try:
        target = link.resolve()
    except (OSError, RuntimeError):
        return False
    return any(target.is_relative_to(root) for root in roots)


def _outside() -> errors.APIError:
    return errors.APIError(403, "path is outside the directories you may register models from.",
                           type="permission_error", param="path", code="path_not_allowed")
