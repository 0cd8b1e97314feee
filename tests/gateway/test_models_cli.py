"""`slinfer models` against the real test gateway, run in-process through `main(argv)`: every
command, `add --wait` following a lifecycle that a stand-in profiler drives, and the errors a
user meets (a wrong key, a refused request, a gateway that is not there) with their exit codes."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.asyncio import Redis

from services import models_cli
from shared.model_state import ModelState, set_hardware_state
from shared.registry import model_id
from tests.gateway.conftest import OPERATOR_KEY, PUBLIC_MODEL
from tests.gateway.test_lifecycle import StandInProfiler, _kinds

pytestmark = pytest.mark.integration


def run(gateway, key: str | None, *argv: str) -> int:
    prefix = ["--url", gateway.url] + (["--key", key] if key else [])
    return models_cli.main(prefix + list(argv))


def test_add_list_alias_status_rm_round_trip(gateway, tenant_models, capsys):
    path = str(tenant_models / "tenant-a" / "tiny")
    assert run(gateway, "key-a", "add", "cli/one", path, "--slo-class", "interactive") == 0
    out = capsys.readouterr().out
    assert out.startswith("registered cli/one\ncli/one: converting\n")
    assert "slo class interactive, owner tenant-a" in out

    assert run(gateway, "key-a", "alias", "cli/one", "cli-fast") == 0
    assert capsys.readouterr().out == "cli-fast -> cli/one\n"
    assert run(gateway, "key-a", "list") == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()}
    assert rows["NAME"] == ["NAME", "STATE", "ENGINE", "OWNER", "BASE", "KEEP-ALIVE", "MIN",
                            "ALIASES"]
    assert rows["cli/one"] == ["cli/one", "converting", "torch", "tenant-a", "-", "default", "0",
                               "cli-fast"]
    assert rows[PUBLIC_MODEL][3] == "public"
    assert run(gateway, "key-a", "alias") == 0
    assert capsys.readouterr().out.splitlines()[1].split() == ["cli-fast", "cli/one", "tenant-a"]

    assert run(gateway, "key-a", "status", "cli/one") == 0
    out = capsys.readouterr().out
    assert "aliases: cli-fast" in out and "converting 0% (queued)" in out
    assert run(gateway, "key-a", "status", "cli-fast") == 1  # an alias is no model to inspect
    assert "'cli-fast' does not exist" in capsys.readouterr().err

    assert run(gateway, "key-a", "alias", "--rm", "cli-fast") == 0
    assert capsys.readouterr().out == "removed alias cli-fast\n"
    assert run(gateway, "key-a", "rm", "cli/one") == 0
    assert capsys.readouterr().out == "deleted cli/one\n"
    assert run(gateway, "key-a", "status", "cli/one") == 1
    err = capsys.readouterr().err
    assert err.startswith("slinfer models: The model 'cli/one' does not exist")
    assert err.rstrip().endswith("(404, model_not_found)")


def test_keep_alive_and_pinning_from_the_cli(gateway, tenant_models, capsys):
    path = str(tenant_models / "tenant-a" / "tiny")
    assert run(gateway, "key-a", "add", "cli/warm", path, "--keep-alive", "5m",
               "--min-instances", "1") == 0
    assert "keep-alive 300s, min instances 1" in capsys.readouterr().out
    assert run(gateway, "key-a", "list") == 0
    row = next(line.split() for line in capsys.readouterr().out.splitlines()
               if line.startswith("cli/warm"))
    assert row[5:7] == ["300s", "1"]
    assert run(gateway, "key-a", "unload", "cli/warm") == 1  # pinned
    assert "min_instances" in capsys.readouterr().err
    assert run(gateway, "key-a", "set", "cli/warm", "--keep-alive", "-1", "--min-instances",
               "0") == 0
    assert capsys.readouterr().out == "cli/warm: keep-alive never, min instances 0\n"
    assert run(gateway, "key-a", "set", "cli/warm", "--keep-alive", "default") == 0
    assert capsys.readouterr().out == "cli/warm: keep-alive default, min instances 0\n"
    assert run(gateway, "key-a", "unload", "cli/warm") == 0  # no instance anywhere: nothing to do
    assert capsys.readouterr().out == "unloading cli/warm\n"
    assert run(gateway, "key-a", "set", "cli/warm", "--keep-alive", "soon") == 1
    assert "(400, invalid_value)" in capsys.readouterr().err
    assert run(gateway, "key-a", "rm", "cli/warm") == 0


async def _output_until(capsys, text: str, seen: list[str], timeout_s: float = 10.0) -> None:
    """Collect the CLI's output (it runs in a thread) until `text` is in it."""
    deadline = time.monotonic() + timeout_s
    while text not in "".join(seen):
        assert time.monotonic() < deadline, f"{text!r} never printed; got {''.join(seen)!r}"
        seen.append(capsys.readouterr().out)
        await asyncio.sleep(0.02)


async def test_add_wait_prints_progress_until_ready(gateway, nats_url, redis_url, model_dir,
                                                    capsys):
    kind = (await _kinds(redis_url))[0]
    argv = ["add", "cli/waited", str(model_dir), "--public", "--wait", "--interval", "0.02", "--timeout", "20"]
    async with StandInProfiler(nats_url, redis_url, kind) as prof:
        cli = asyncio.create_task(asyncio.to_thread(run, gateway, OPERATOR_KEY, *argv))
        seen: list[str] = []
        try:
            await prof.take("cli/waited")
            await _output_until(capsys, f"{kind}: converting 0% (queued)", seen)
            await prof.report("cli/waited", ModelState.PROFILING, "decode table", 0.4)
            await _output_until(capsys, f"{kind}: profiling 40% (decode table)", seen)
            await prof.report("cli/waited", ModelState.READY, "", 1.0)
            assert await asyncio.wait_for(cli, 10) == 0
            assert "".join(seen) + capsys.readouterr().out == (
                f"registered cli/waited\n{kind}: converting 0% (queued)\n"
                f"{kind}: profiling 40% (decode table)\n{kind}: ready\ncli/waited is ready\n")
        finally:
            await asyncio.wait_for(cli, 10)
            run(gateway, OPERATOR_KEY, "rm", "cli/waited")


async def test_add_wait_exits_1_when_the_model_fails(gateway, redis_url, tenant_models, capsys):
    kinds = await _kinds(redis_url)
    path = str(tenant_models / "tenant-b" / "tiny")
    argv = ["add", "cli-broken", path, "--wait", "--interval", "0.02", "--timeout", "20"]
    cli = asyncio.create_task(asyncio.to_thread(run, gateway, "key-b", *argv))
    seen: list[str] = []
    redis = Redis.from_url(redis_url)
    try:
        await _output_until(capsys, "converting", seen)
        for kind in kinds:
            await set_hardware_state(redis, model_id("cli-broken", "tenant-b"), kind,
                                     ModelState.FAILED, "the weights do not load")
        assert await asyncio.wait_for(cli, 10) == 1
        out = "".join(seen) + capsys.readouterr().out
        assert f"{kinds[0]}: failed (the weights do not load)" in out
        assert out.endswith("cli-broken failed\n")
    finally:
        await asyncio.wait_for(cli, 10)
        await redis.aclose()
        run(gateway, "key-b", "rm", "cli-broken")
    assert run(gateway, "key-b", "status", "cli-broken") == 1  # deleted now: 404


def test_add_wait_gives_up_after_its_timeout(gateway, tenant_models, capsys):
    path = str(tenant_models / "tenant-a" / "tiny")
    try:
        assert run(gateway, "key-a", "add", "cli-slow", path, "--wait", "--timeout", "0.2",
                   "--interval", "0.05") == 1
        assert "cli-slow is not ready after 0.2 s (state converting)" in capsys.readouterr().err
    finally:
        assert run(gateway, "key-a", "rm", "cli-slow") == 0


def test_errors_say_what_the_gateway_said(gateway, model_dir, capsys, monkeypatch):
    assert run(gateway, "wrong-key", "list") == 1
    assert "Invalid or missing API key" in capsys.readouterr().err
    # A tenant may not publish; the gateway's reason comes through.
    assert run(gateway, "key-a", "add", "cli-pub", str(model_dir), "--public") == 1
    assert "Only the operator may register public models. (403, permission_denied)" in \
        capsys.readouterr().err
    assert run(gateway, "key-a", "alias", PUBLIC_MODEL, "cli-x") == 1
    assert "Only the operator may alias the public model" in capsys.readouterr().err
    # The key from the environment.
    monkeypatch.setenv("SLINFER_API_KEY", "key-b")
    assert models_cli.main(["--url", gateway.url, "list"]) == 0
    assert PUBLIC_MODEL in capsys.readouterr().out

