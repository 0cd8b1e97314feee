"""Chunked parallel O_DIRECT reads: alignment rules, chunk edges, page-cache helpers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from services.node.loader.direct_io import (ParallelReader, ReadJob, aligned_buffer,
                                            drop_page_cache, open_direct, resident_bytes,
                                            write_direct)

ALIGN = 4096


def _file(path: Path, size: int, seed: int = 0) -> bytes:
    data = torch.randint(0, 256, (size,), generator=torch.Generator().manual_seed(seed),
                         dtype=torch.uint8).numpy().tobytes()
    path.write_bytes(data)
    return data


def _direct_supported(path: Path) -> bool:
    fd, direct = open_direct(path)
    os.close(fd)
    return direct


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 4097, 3 * 4096 + 5])
def test_buffers_are_aligned_and_rounded_up(nbytes):
    buffer = aligned_buffer(nbytes)
    assert buffer.data_ptr() % ALIGN == 0
    assert buffer.numel() % ALIGN == 0 and buffer.numel() >= nbytes


@pytest.mark.parametrize("chunk_pages,threads", [(1, 1), (2, 3), (3, 8), (64, 2)])
def test_reads_are_exact_at_every_chunk_edge(tmp_path, chunk_pages, threads):
    """Files of 1, 5 and 7 pages with chunks that divide them or not: the last chunk is short."""
    reader = ParallelReader(threads, chunk_pages * ALIGN)
    try:
        files = [(tmp_path / f"f{i}", pages * ALIGN) for i, pages in enumerate((1, 5, 7))]
        data = [_file(path, size, seed=i) for i, (path, size) in enumerate(files)]
        buffers = [aligned_buffer(size) for _, size in files]
        stats = reader.read([ReadJob(p, s, b) for (p, s), b in zip(files, buffers)])
        assert stats.bytes == sum(s for _, s in files)
        for expected, buffer, (_, size) in zip(data, buffers, files):
            assert buffer[:size].numpy().tobytes() == expected
    finally:
        reader.close()


def test_o_direct_is_used_where_the_filesystem_has_it(tmp_path):
    path = tmp_path / "f"
    _file(path, 2 * ALIGN)
    reader = ParallelReader(2, ALIGN)
    try:
        stats = reader.read([ReadJob(path, 2 * ALIGN, aligned_buffer(2 * ALIGN))])
    finally:
        reader.close()
    assert stats.direct == _direct_supported(path)


def test_unaligned_jobs_are_refused(tmp_path):
    path = tmp_path / "f"
    _file(path, 2 * ALIGN)
    reader = ParallelReader(2, ALIGN)
    try:
        with pytest.raises(ValueError):  # a size that is not a multiple of 4096
            reader.read([ReadJob(path, ALIGN + 100, aligned_buffer(2 * ALIGN))])
        with pytest.raises(ValueError):  # a buffer address off the alignment
            reader.read([ReadJob(path, ALIGN, aligned_buffer(3 * ALIGN)[1:])])
        with pytest.raises(ValueError):  # a buffer smaller than the read
            reader.read([ReadJob(path, 2 * ALIGN, aligned_buffer(ALIGN))])
        with pytest.raises(EOFError):  # the file is shorter than the job says
            reader.read([ReadJob(path, 4 * ALIGN, aligned_buffer(4 * ALIGN))])
    finally:
        reader.close()
    with pytest.raises(ValueError):
        ParallelReader(1, 1000)  # chunk not a multiple of the alignment


def test_write_direct_round_trips(tmp_path):
    buffer = aligned_buffer(3 * ALIGN)
    buffer.copy_(torch.arange(3 * ALIGN) % 251)
    stats = write_direct(tmp_path / "w", buffer, 3 * ALIGN)
    assert stats.bytes == 3 * ALIGN
    assert (tmp_path / "w").read_bytes() == buffer.numpy().tobytes()
    with pytest.raises(ValueError):
        write_direct(tmp_path / "x", buffer, ALIGN + 1)


def test_page_cache_drop_is_visible_to_mincore(tmp_path):
    path = tmp_path / "cached"
    _file(path, 64 * ALIGN)
    path.read_bytes()  # buffered read: in the page cache now
    assert resident_bytes(path) == 64 * ALIGN
    drop_page_cache(path)
    assert resident_bytes(path) < 64 * ALIGN // 4
    # An O_DIRECT read leaves nothing cached.
    reader = ParallelReader(2, 16 * ALIGN)
    try:
        stats = reader.read([ReadJob(path, 64 * ALIGN, aligned_buffer(64 * ALIGN))])
    finally:
        reader.close()
    if stats.direct:
        assert resident_bytes(path) < 64 * ALIGN // 4
