"""`slinfer convert-checkpoint`: a Hugging Face safetensors checkpoint -> the loading-optimized
format of `checkpoint_format` (written once, at registration or on first load; read many times).

The conversion copies raw tensor bytes: safetensors headers give each tensor's dtype, shape and
byte range, so nothing is decoded and no dtype changes. Tensors are packed into partitions of
about `partition_bytes`, each at an ALIGNMENT boundary, in the order a model runs (`run_order`):
what is not a decoder layer (embeddings, final norm, LM head: the *head*) first, then the
decoder layers by number. A safetensors file sorts its tensors by name (layers 0, 1, 10, 11, 2,
...), so a prefix of its bytes holds scattered layers; in run order a prefix holds the head and
layers 0..p-1, which is what execute-while-load needs from the first blocks of a multicast
(λScale §4.3: the node runs the layers it holds, a helper the rest, with two activation hops) and
what the core's plans assume (`shared.core.pipeline.model_layout`, whose head the multicast sends
first wherever its bytes lie). Everything is written into a temporary
directory beside the target and renamed into place at the end, so a crash leaves no half
checkpoint, and a second run that finds a complete checkpoint of the same source does nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import tempfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from shared.core.pipeline import layer_index

from .checkpoint_format import (ALIGNMENT, INDEX_FILE, SAFETENSORS_DTYPES, CheckpointIndex,
                                Partition, TensorEntry, align_up, default_checkpoint_dir,
                                read_index, source_fingerprint, source_weight_files)

DEFAULT_PARTITION_BYTES = 1 << 30
COPY_CHUNK = 16 << 20


@dataclass(frozen=True)
class SourceTensor:
    name: str
    dtype: str  # torch dtype name
    shape: tuple[int, ...]
    path: Path  # safetensors file
    start: int  # absolute byte offset of the data in that file
    size: int


@dataclass(frozen=True)
class ConvertResult:
    path: Path  # the checkpoint directory
    converted: bool  # False: a complete checkpoint of the same source was already there
    index: CheckpointIndex


def read_safetensors_header(path: Path) -> list[SourceTensor]:
    """The tensors of one safetensors file, in the order of their data in the file."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    base = 8 + header_len
    tensors = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"{path.name}: tensor {name} has unsupported dtype {meta['dtype']}")
        begin, end = meta["data_offsets"]
        tensors.append(SourceTensor(name, SAFETENSORS_DTYPES[meta["dtype"]],
                                    tuple(meta["shape"]), path, base + begin, end - begin))
    return sorted(tensors, key=lambda t: t.start)


def source_tensors(model_dir: Path) -> list[SourceTensor]:
    files = source_weight_files(model_dir)
    if not files:
        raise ValueError(f"{model_dir} has no *.safetensors files (only safetensors checkpoints "
                         "can be converted)")
    tensors = [t for path in files for t in read_safetensors_header(path)]
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise ValueError(f"{model_dir}: a tensor name appears in more than one file")
    return tensors


def run_order(tensors: list[SourceTensor]) -> list[SourceTensor]:
    """The head's tensors, then each decoder layer's, layer by layer; the source order within
    each (a stable sort)."""
    def key(t: SourceTensor) -> int:
        layer = layer_index(t.name)
        return -1 if layer is None else layer

    return sorted(tensors, key=key)


def plan_layout(tensors: list[SourceTensor], partition_bytes: int
                ) -> list[list[tuple[SourceTensor, int]]]:
    """Partitions as lists of (tensor, aligned offset): filled in order up to partition_bytes
    (a tensor larger than that gets a partition of its own)."""
    partitions: list[list[tuple[SourceTensor, int]]] = [[]]
    offset = 0
    for tensor in tensors:
        if partitions[-1] and offset + tensor.size > partition_bytes:
            partitions.append([])
            offset = 0
        partitions[-1].append((tensor, offset))
        offset = align_up(offset + tensor.size)
    return partitions


def convert_checkpoint(model_dir: str | Path, out_dir: str | Path | None = None,
                       partition_bytes: int = DEFAULT_PARTITION_BYTES,
                       progress: bool = False) -> ConvertResult:
    """Convert `model_dir`'s safetensors into a checkpoint at `out_dir` (default: the model's
    `slinfer-checkpoint/`); does nothing when a complete one of the same source is there."""
    model_dir = Path(model_dir)
    out = Path(out_dir) if out_dir is not None else default_checkpoint_dir(model_dir)
    fingerprint = source_fingerprint(model_dir)
    existing = read_index(out)
    if existing is not None and existing.fingerprint == fingerprint:
        return ConvertResult(out, False, existing)
    tensors = run_order(source_tensors(model_dir))
    layout = plan_layout(tensors, partition_bytes)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        index = _write_partitions(tmp, fingerprint, layout, progress)
        (tmp / INDEX_FILE).write_text(index.to_json())
        _fsync_dir(tmp)
        tmp.chmod(0o755)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        _fsync_dir(out.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ConvertResult(out, True, index)


def _write_partitions(tmp: Path, fingerprint: str,
                      layout: list[list[tuple[SourceTensor, int]]], progress: bool
                      ) -> CheckpointIndex:
    from tqdm import tqdm

    total = sum(t.size for part in layout for t, _ in part)
    entries: list[TensorEntry] = []
    partitions: list[Partition] = []
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
              desc="convert-checkpoint", disable=not progress) as bar:
        for number, part in enumerate(layout):
            name = f"part-{number:05d}.bin"
            crc, size = _write_partition(tmp / name, part, bar.update)
            partitions.append(Partition(name, size, crc))
            entries += [TensorEntry(t.name, t.dtype, t.shape, name, offset, t.size)
                        for t, offset in part]
    return CheckpointIndex(fingerprint, tuple(partitions), tuple(entries))


def _write_partition(path: Path, part: list[tuple[SourceTensor, int]], advance
                     ) -> tuple[int, int]:
    """Write the tensors at their offsets, zero padding between them and up to ALIGNMENT at the
    end; returns (crc32 of the file, its size)."""
    crc = 0
    position = 0
    sources: dict[Path, object] = {}
    try:
        with open(path, "wb") as f:
            for tensor, offset in part:
                pad = bytes(offset - position)
                f.write(pad)
                crc = zlib.crc32(pad, crc)
                if tensor.path not in sources:
                    sources[tensor.path] = open(tensor.path, "rb")
                src = sources[tensor.path]
                for chunk in _chunks(src, tensor.start, tensor.size):
                    f.write(chunk)
                    crc = zlib.crc32(chunk, crc)
                    advance(len(chunk))
                position = offset + tensor.size
            pad = bytes(align_up(position) - position)
            f.write(pad)
            crc = zlib.crc32(pad, crc)
            f.flush()
            os.fsync(f.fileno())
    finally:
        for src in sources.values():
            src.close()
    return crc, align_up(position)


def _chunks(f, start: int, size: int) -> Iterator[bytes]:
    f.seek(start)
    left = size
    while left:
        chunk = f.read(min(COPY_CHUNK, left))
        if not chunk:
            raise EOFError(f"{f.name} ended {left} bytes early")
        left -= len(chunk)
        yield chunk


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verify_checkpoint(checkpoint_dir: str | Path) -> list[str]:
    """Problems found by re-reading every partition against its CRC (empty: all good)."""
    checkpoint_dir = Path(checkpoint_dir)
    index = read_index(checkpoint_dir)
    if index is None:
        return [f"{checkpoint_dir} holds no complete checkpoint"]
    problems = []
    for part in index.partitions:
        crc = 0
        with open(checkpoint_dir / part.file, "rb") as f:
            while chunk := f.read(COPY_CHUNK):
                crc = zlib.crc32(chunk, crc)
        if crc != part.crc32:
            problems.append(f"{part.file}: crc32 {crc:#010x} != {part.crc32:#010x}")
    for entry in index.tensors:
        if entry.offset % ALIGNMENT:
            problems.append(f"{entry.name}: offset {entry.offset} is not aligned")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="slinfer convert-checkpoint",
        description="Convert a Hugging Face safetensors checkpoint into slinfer's "
                    "loading-optimized format (aligned partitions + index) for fast loads. "
                    "A complete checkpoint of the same source is left as it is.")
    p.add_argument("--model", required=True, type=Path, help="Hugging Face model directory")
    p.add_argument("--out", type=Path,
                   help="checkpoint directory (default: MODEL/slinfer-checkpoint)")
    p.add_argument("--partition-bytes", type=int, default=DEFAULT_PARTITION_BYTES)
    p.add_argument("--verify", action="store_true", help="re-read the result against its CRCs")
    args = p.parse_args(argv)
    try:
        result = convert_checkpoint(args.model, args.out, args.partition_bytes, progress=True)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    state = "converted" if result.converted else "up to date"
    index = result.index
    print(f"{state}: {result.path} ({len(index.tensors)} tensors, {index.file_bytes} bytes in "
          f"{len(index.partitions)} partitions)")
    if args.verify and (problems := verify_checkpoint(result.path)):
        print("\n".join(problems), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
