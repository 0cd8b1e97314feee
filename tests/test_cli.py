"""`slinfer` CLI: help, unknown commands, and modules that are not there."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

from services import cli

SLINFER = Path(sys.executable).parent / "slinfer"


def test_help_lists_every_command_with_a_summary(capsys) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("up", "gateway", "placer", "node", "make-model", "profile", "simulate"):
        line = next((ln for ln in out.splitlines() if ln.strip().startswith(name + " ")), None)
        assert line is not None, f"{name} missing from --help:\n{out}"
        assert len(line.split(None, 1)[1]) > 10  # a real one-line summary


def test_installed_script_help() -> None:
    if not SLINFER.exists():
        pytest.skip(f"{SLINFER} not installed (run `make install`)")
    done = subprocess.run([str(SLINFER), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "make-model" in done.stdout and "simulate" in done.stdout


def test_unknown_command_fails_with_a_clear_message(capsys) -> None:
    assert cli.main(["frobnicate"]) != 0
    err = capsys.readouterr().err
    assert "unknown command 'frobnicate'" in err
    assert "usage: slinfer" in err


def test_no_command_prints_usage_and_fails(capsys) -> None:
    assert cli.main([]) != 0
    assert "usage: slinfer" in capsys.readouterr().out


def test_missing_module_is_a_clear_error_not_a_traceback(monkeypatch, capsys) -> None:
    monkeypatch.setitem(cli.COMMANDS, "ghost", cli.Command("services.does_not_exist", "nothing"))
    assert cli.main(["ghost"]) == 2
    err = capsys.readouterr().err
    assert "services.does_not_exist does not exist" in err
    assert "Traceback" not in err


def test_missing_dependency_names_it(monkeypatch, capsys, tmp_path) -> None:
    (tmp_path / "needs_dep_mod.py").write_text("import surely_not_installed_pkg\ndef main(argv): return 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.COMMANDS, "dep", cli.Command("needs_dep_mod", "nothing"))
    assert cli.main(["dep"]) == 2
    assert "'surely_not_installed_pkg'" in capsys.readouterr().err


def test_dispatch_passes_remaining_args_and_exit_code(monkeypatch) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("fake_cmd_mod")
    fake.main = lambda argv: seen.append(argv) or 7
    monkeypatch.setitem(sys.modules, "fake_cmd_mod", fake)
    monkeypatch.setitem(cli.COMMANDS, "fake", cli.Command("fake_cmd_mod", "a fake"))
    assert cli.main(["fake", "--port", "9"]) == 7
    assert seen == [["--port", "9"]]


def test_module_without_main_is_reported(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "no_main_mod", types.ModuleType("no_main_mod"))
    monkeypatch.setitem(cli.COMMANDS, "nomain", cli.Command("no_main_mod", "x"))
    assert cli.main(["nomain"]) == 2
    assert "has no main(argv)" in capsys.readouterr().err
