"""The loading-optimized checkpoint format (ServerlessLLM §4.1), as files on disk.

A checkpoint directory holds a few partition files and one index:

    index.json          what is where: every tensor's name, dtype, shape, file, offset, size
    part-00000.bin      raw tensor bytes, nothing else (no headers, no metadata)
    part-00001.bin      ...

Every tensor starts at an offset that is a multiple of ALIGNMENT (4096), and every partition's
size is one too. So a partition is read whole, in large chunks, with O_DIRECT into page-aligned
memory, and each tensor is then a view at `buffer + offset`: no parsing, no per-tensor copy, and
every tensor's address is aligned for any dtype and SIMD width. `index.json` is written last, by
an atomic rename of the whole directory, so its presence means the checkpoint is complete.

The index also records the source checkpoint's fingerprint (names, sizes and mtimes of its weight
files plus its config), so a conversion can tell that an existing checkpoint is of the same source
and skip the work, and a loader can tell that a cached copy is stale.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

FORMAT = "slinfer-checkpoint"
VERSION = 1
ALIGNMENT = 4096  # O_DIRECT's offset/length/address unit on every common block device and fs
INDEX_FILE = "index.json"
CHECKPOINT_SUBDIR = "slinfer-checkpoint"  # default place of the converted checkpoint in a model dir
SOURCE_CONFIG_FILES = ("config.json",)

# safetensors dtype tags -> torch dtype names (the index stores torch's names).
SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    file: str  # partition file name inside the checkpoint directory
    offset: int  # byte offset in that file, a multiple of ALIGNMENT
    size: int  # bytes of tensor data (no padding)


@dataclass(frozen=True)
class Partition:
    file: str
    size: int  # bytes on disk, a multiple of ALIGNMENT (tensor data + zero padding)
    crc32: int  # of the whole file, for `verify`


@dataclass(frozen=True)
class CheckpointIndex:
    fingerprint: str  # of the source checkpoint (see `source_fingerprint`)
    partitions: tuple[Partition, ...]
    tensors: tuple[TensorEntry, ...]
    alignment: int = ALIGNMENT

    @property
    def tensor_bytes(self) -> int:
        return sum(t.size for t in self.tensors)

    @property
    def file_bytes(self) -> int:
        """What a load reads: the partitions, padding included."""
        return sum(p.size for p in self.partitions)

    def to_json(self) -> str:
        body = {"format": FORMAT, "version": VERSION, "alignment": self.alignment,
                "fingerprint": self.fingerprint, "tensor_bytes": self.tensor_bytes,
                "partitions": [asdict(p) for p in self.partitions],
                "tensors": [asdict(t) for t in self.tensors]}
        return json.dumps(body, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> CheckpointIndex:
        body = json.loads(text)
        if body.get("format") != FORMAT or body.get("version") != VERSION:
            raise ValueError(f"not a {FORMAT} v{VERSION} index")
        tensors = tuple(TensorEntry(t["name"], t["dtype"], tuple(t["shape"]), t["file"],
                                    t["offset"], t["size"]) for t in body["tensors"])
        partitions = tuple(Partition(p["file"], p["size"], p["crc32"])
                           for p in body["partitions"])
        return cls(body["fingerprint"], partitions, tensors, body["alignment"])


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


def read_index(checkpoint_dir: Path) -> CheckpointIndex | None:
    """The checkpoint's index, or None when the directory holds no complete checkpoint (no
    index, an unreadable one, or a partition missing or of the wrong size)."""
    try:
        index = CheckpointIndex.from_json((Path(checkpoint_dir) / INDEX_FILE).read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    for part in index.partitions:
        try:
            if (Path(checkpoint_dir) / part.file).stat().st_size != part.size:
                return None
        except OSError:
            return None
    return index


def source_weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a Hugging Face directory, in name order."""
    return sorted(Path(model_dir).glob("*.safetensors"))


def source_fingerprint(model_dir: Path) -> str:
    """Identity of a Hugging Face checkpoint from file metadata (cheap: stat calls and the small
    config), so it can be checked on every load: names, sizes and mtimes of the weight files."""
    model_dir = Path(model_dir)
    digest = hashlib.sha256(f"{FORMAT}-{VERSION}".encode())
    for path in source_weight_files(model_dir):
        st = path.stat()
        digest.update(f"{path.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    for name in SOURCE_CONFIG_FILES:
        if (model_dir / name).is_file():
            digest.update((model_dir / name).read_bytes())
    return digest.hexdigest()[:32]


def default_checkpoint_dir(model_dir: Path) -> Path:
    """Where `convert` writes and the loader looks for a model's converted checkpoint: beside
    the model's own files, in the registry's storage."""
    return Path(model_dir) / CHECKPOINT_SUBDIR
