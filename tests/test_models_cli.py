"""`slinfer models`: argument parsing, exit codes of usage errors, the output formats, and a
gateway that is not there (the commands against a real gateway: tests/gateway/test_models_cli.py)."""

from __future__ import annotations

import json

import pytest

from services import cli, models_cli
from shared.servers import free_port

READY_MODEL = {
    "name": "org/m", "engine": "torch", "slo_class": "standard", "owner": None,
    "base_model": None, "max_context": 2048, "aliases": ["m", "gpt-x"], "keep_alive_s": 300.0,
    "min_instances": 1,
    "lifecycle": {"state": "ready", "hardware": {
        "cpu": {"state": "ready", "progress": 1.0, "reason": "", "updated": 1.0},
        "cuda": {"state": "profiling", "progress": 0.375, "reason": "decode table", "updated": 1.0},
    }},
}


def test_defaults_and_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("SLINFER_URL", raising=False)
    monkeypatch.delenv("SLINFER_API_KEY", raising=False)
    args = models_cli.parse(["add", "m", "/models/m"])
    assert (args.url, args.key) == ("http://127.0.0.1:8000", None)
    assert (args.engine, args.slo_class, args.public, args.wait, args.replace) == \
        ("torch", "standard", False, False, False)
    monkeypatch.setenv("SLINFER_URL", "http://gw:9000")
    monkeypatch.setenv("SLINFER_API_KEY", "k")
    args = models_cli.parse(["list"])
    assert (args.url, args.key) == ("http://gw:9000", "k")
    args = models_cli.parse(["--url", "http://x", "--key", "other", "add", "m", "/p", "--wait",
                             "--timeout", "5", "--public", "--base-model", "b"])
    assert (args.url, args.key, args.wait, args.timeout, args.public, args.base_model) == \
        ("http://x", "other", True, 5.0, True, "b")


@pytest.mark.parametrize("argv", [
    [], ["frobnicate"], ["add", "only-a-name"], ["rm"], ["status"],
    ["add", "m", "/p", "--engine", "tensorrt"], ["add", "m", "/p", "--timeout", "soon"],
    ["alias", "model-without-alias"], ["alias", "m", "a", "--rm", "a"],
    ["set", "m"], ["add", "m", "/p", "--min-instances", "one"], ["load"], ["unload"],
])
def test_usage_errors_exit_2(argv, capsys) -> None:
    assert models_cli.main(argv) == 2
    assert "usage: slinfer models" in capsys.readouterr().err


def test_help_exits_0_and_the_command_is_listed(capsys) -> None:
    assert models_cli.main(["--help"]) == 0
    assert "add" in capsys.readouterr().out
    assert cli.main(["--help"]) == 0
    assert any(line.split()[:1] == ["models"] for line in capsys.readouterr().out.splitlines())
    assert cli.main(["models", "alias", "--help"]) == 0


def test_gateway_errors_in_one_line() -> None:
    body = json.dumps({"error": {"message": "The model 'x' does not exist.", "type": "x",
                                 "param": "model", "code": "model_not_found"}}).encode()
    assert models_cli.http_error(404, body) == "The model 'x' does not exist. (404, model_not_found)"
    no_code = json.dumps({"error": {"message": "Down.", "code": None}}).encode()
    assert models_cli.http_error(503, no_code) == "Down. (503)"
    assert models_cli.http_error(502, b"<html>Bad Gateway</html>") == \
        "the gateway answered 502: <html>Bad Gateway</html>"
    assert models_cli.http_error(500, b"") == "the gateway answered 500"


def test_list_is_a_table_with_aliases() -> None:
    lora = {"name": "ad", "engine": "torch", "owner": "tenant-a", "base_model": "org/m",
            "aliases": [], "lifecycle": {"state": "converting", "hardware": {}}}
    lines = models_cli.list_text([READY_MODEL, lora]).splitlines()
    assert [line.split() for line in lines] == [
        ["NAME", "STATE", "ENGINE", "OWNER", "BASE", "KEEP-ALIVE", "MIN", "ALIASES"],
        ["org/m", "ready", "torch", "public", "-", "300s", "1", "m,", "gpt-x"],
        ["ad", "converting", "torch", "tenant-a", "org/m", "default", "0", "-"]]
    assert lines[1].index("ready") == lines[0].index("STATE")  # columns line up
    assert models_cli.list_text([]) == "no models registered"


def test_status_shows_each_hardware_kind_with_progress() -> None:
    assert models_cli.status_text(READY_MODEL).splitlines() == [
        "org/m: ready",
        "  engine torch, slo class standard, owner public, context 2048 tokens",
        "  keep-alive 300s, min instances 1",
        "  aliases: m, gpt-x",
        "  cpu: ready",
        "  cuda: profiling 38% (decode table)"]
    bare = {**READY_MODEL, "aliases": [], "lifecycle": {"state": "not_profiled", "hardware": {}}}
    assert models_cli.status_text(bare).splitlines()[-1] == \
        "  not profiled on any hardware kind yet"
    failed = {"state": "failed", "progress": 0.5, "reason": "OSError: disk"}
    assert models_cli.kind_line("cpu", failed) == "cpu: failed (OSError: disk)"


def test_keep_alive_as_shown() -> None:
    assert [models_cli.keep_alive_text(s) for s in (None, -1.0, 0.0, 300.0, 2.5)] == \
        ["default", "never", "0s", "300s", "2.5s"]


def test_model_names_with_slashes_stay_paths() -> None:
    assert models_cli.model_path("org/m 1") == "/admin/models/org/m%201"


def test_a_gateway_that_is_not_there(capsys) -> None:
    assert models_cli.main(["--url", f"http://127.0.0.1:{free_port()}", "list"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("slinfer models: cannot reach the gateway at http://127.0.0.1:")
    assert "slinfer up" in err
