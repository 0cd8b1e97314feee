"""`publish_dir`: a model directory appears whole, and a complete one is never pulled from under
its readers by a slower concurrent writer (two pytest workers, two nodes sharing a volume)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.model_dirs import publish_dir


def _complete(d: Path) -> bool:
    return (d / "done").is_file()


def _fill(tag: str):
    def fill(staging: Path) -> None:
        (staging / "weights").write_text(tag)
        (staging / "done").write_text("")
    return fill


def test_a_fresh_directory_is_published_whole(tmp_path: Path) -> None:
    target = publish_dir(tmp_path / "m", _fill("a"), _complete)
    assert (target / "weights").read_text() == "a" and _complete(target)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no staging left behind


def test_a_slower_writer_leaves_the_complete_directory_in_place(tmp_path: Path) -> None:
    target = tmp_path / "m"

    def slow_fill(staging: Path) -> None:  # the other writer finishes while this one works
        publish_dir(target, _fill("first"), _complete)
        reader = (target / "weights").open()  # a reader of the first copy
        _fill("second")(staging)
        slow_fill.reader = reader

    publish_dir(target, slow_fill, _complete)
    assert (target / "weights").read_text() == "first"
    assert slow_fill.reader.read() == "first"
    slow_fill.reader.close()
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_an_incomplete_leftover_is_replaced(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "weights").write_text("half")
    target = publish_dir(tmp_path / "m", _fill("whole"), _complete)
    assert (target / "weights").read_text() == "whole"


def test_a_failing_fill_leaves_nothing(tmp_path: Path) -> None:
    def broken(staging: Path) -> None:
        raise RuntimeError("conversion failed")

    with pytest.raises(RuntimeError):
        publish_dir(tmp_path / "m", broken, _complete)
    assert list(tmp_path.iterdir()) == []
