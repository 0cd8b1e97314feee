"""`slinfer models add|list|rm|status|alias|set|load|unload`: the admin API's model commands,
over HTTP.

It talks to a running gateway (`--url`, default http://127.0.0.1:8000; `--key` or
SLINFER_API_KEY for a gateway with keys) and needs nothing but the standard library, so it runs
wherever Python does. `add --wait` follows the model's lifecycle (converting, profiling, per
hardware kind, with progress) until it is ready or failed. `--keep-alive` (seconds or a duration
such as "5m"; 0: unload at once when idle; negative: never) and `--min-instances` (warm
instances kept, pinned) are set at `add` or later with `set`; `load` starts an instance now and
`unload` unloads the model's instances now (busy ones when their requests end).

Exit codes: 0 done; 1 the gateway refused or failed it, could not be reached, or the model
failed (or, with --wait, did not get ready in time); 2 a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO
from urllib.parse import quote

DEFAULT_URL = "http://127.0.0.1:8000"
FINAL_STATES = ("ready", "failed")


class CliError(Exception):
    """A failure to report in one line (exit code 1)."""


@dataclass(frozen=True)
class Gateway:
    """The admin API of one gateway. `call` raises CliError with the gateway's own message."""

    url: str
    key: str | None = None
    timeout_s: float = 30.0

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url.rstrip("/") + path, data=data, method=method)
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if self.key:
            request.add_header("Authorization", f"Bearer {self.key}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            raise CliError(http_error(exc.code, exc.read())) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise CliError(f"cannot reach the gateway at {self.url}: {reason} (is it running? "
                           "`slinfer up` starts one; --url points elsewhere)") from None
        except json.JSONDecodeError:
            raise CliError(f"the gateway at {self.url} answered {method} {path} with no "
                           "JSON (is this a slinfer gateway?)") from None


def http_error(status: int, body: bytes) -> str:
    """The gateway's error in one line: its message and code when the body is an OpenAI error."""
    try:
        error = json.loads(body)["error"]
        message, code = error["message"], error.get("code")
    except (ValueError, KeyError, TypeError):
        text = body.decode(errors="replace").strip()[:200]
        return f"the gateway answered {status}{': ' + text if text else ''}"
    return f"{message} ({status}{', ' + code if code else ''})"


def model_path(name: str) -> str:
    return "/admin/models/" + quote(name, safe="/")


# --- output ---------------------------------------------------------------------------------------


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    return "\n".join(lines)


def list_text(models: list[dict[str, Any]]) -> str:
    if not models:
        return "no models registered"
    rows = [[m["name"], m.get("lifecycle", {}).get("state", "?"), m.get("engine", "?"),
             m.get("owner") or "public", m.get("base_model") or "-",
             keep_alive_text(m.get("keep_alive_s")), str(m.get("min_instances", 0)),
             ", ".join(m.get("aliases", [])) or "-"] for m in models]
    return table(rows, ["NAME", "STATE", "ENGINE", "OWNER", "BASE", "KEEP-ALIVE", "MIN",
                        "ALIASES"])


def keep_alive_text(seconds: float | None) -> str:
    """A record's keep_alive_s as read: `default`, `never`, `0s`, `300s`."""
    if seconds is None:
        return "default"
    return "never" if seconds < 0 else f"{seconds:g}s"


def kind_line(kind: str, step: dict[str, Any]) -> str:
    """One hardware kind's lifecycle step: `cpu: profiling 40% (decode table)`."""
    state = step.get("state", "?")
    progress = "" if state in FINAL_STATES else f" {round(100 * step.get('progress', 0.0))}%"
    reason = step.get("reason") or ""
    return f"{kind}: {state}{progress}{f' ({reason})' if reason else ''}"


def status_text(model: dict[str, Any]) -> str:
    life = model.get("lifecycle") or {}
    lines = [f"{model['name']}: {life.get('state', '?')}",
             f"  engine {model.get('engine', '?')}, slo class {model.get('slo_class', '?')}, "
             f"owner {model.get('owner') or 'public'}, context {model.get('max_context', '?')} tokens"]
    if model.get("base_model"):
        lines.append(f"  LoRA adapter of {model['base_model']}")
    lines.append(f"  keep-alive {keep_alive_text(model.get('keep_alive_s'))}, min instances "
                 f"{model.get('min_instances', 0)}")
    if model.get("aliases"):
        lines.append(f"  aliases: {', '.join(model['aliases'])}")
    hardware = life.get("hardware") or {}
    lines += [f"  {kind_line(k, s)}" for k, s in sorted(hardware.items())]
    if not hardware:
        lines.append("  not profiled on any hardware kind yet")
    return "\n".join(lines)


# --- commands ---------------------------------------------------------------------------------


def cmd_add(gw: Gateway, args: argparse.Namespace, out: TextIO) -> int:
    body: dict[str, Any] = {"name": args.name, "path": args.path, "engine": args.engine,
                            "slo_class": args.slo_class, "public": args.public,
                            "replace": args.replace}
    if args.base_model:
        body["base_model"] = args.base_model
    if args.keep_alive is not None:
        body["keep_alive"] = args.keep_alive
    if args.min_instances is not None:
        body["min_instances"] = args.min_instances
    model = gw.call("POST", "/admin/models", body)
    print(f"registered {model['name']}", file=out)
    if not args.wait:
        print(status_text(model), file=out)
        return 0 if model.get("lifecycle", {}).get("state") != "failed" else 1
    return wait_ready(gw, model["name"], args.timeout, args.interval, out)


def wait_ready(gw: Gateway, name: str, timeout_s: float, interval_s: float, out: TextIO,
               clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep) -> int:
    """Print each change of the model's lifecycle until it is ready (0) or failed (1); 1 too
    when `timeout_s` passes first."""
    deadline, shown = clock() + timeout_s, set()
    while True:
        life = gw.call("GET", model_path(name)).get("lifecycle") or {}
        for kind, step in sorted((life.get("hardware") or {}).items()):
            line = kind_line(kind, step)
            if line not in shown:
                shown.add(line)
                print(line, file=out, flush=True)
        state = life.get("state")
        if state == "ready":
            print(f"{name} is ready", file=out)
            return 0
        if state == "failed":
            print(f"{name} failed", file=out)
            return 1
        if clock() >= deadline:
            raise CliError(f"{name} is not ready after {timeout_s:g} s (state {state}); "
                           f"`slinfer models status {name}` follows it")
        sleep(interval_s)


def cmd_list(gw: Gateway, args: argparse.Namespace, out: TextIO) -> int:
    models = gw.call("GET", "/admin/models")["data"]
    print(json.dumps(models, indent=2) if args.json else list_text(models), file=out)
    return 0


def cmd_status(gw: Gateway, args: argparse.Namespace, out: TextIO) -> int:
    model = gw.call("GET", model_path(args.name))
    print(json.dumps(model, indent=2) if args.json else status_text(model), file=out)
    return 1 if (model.get("lifecycle") or {}).get("state") == "failed" else 0


def cmd_rm(gw: Gateway, args: argparse.Namespace, out: TextIO) -> int:
    gw.call("DELETE", model_path(args.name))
    print(f"deleted {args.name}", file=out)
    return 0


def cmd_set(gw: Gateway, args: argparse.Namespace, out: TextIO) -> int:
    body: dict[str, Any] = {}
    if args.keep_alive is not None:  # "default": back to the cluster's keep-alive
        body["keep_alive"] = None if args.keep_alive == "default" else args.keep_alive
    if args.min_instances is not None:
        body["min_instances"] = args.min_instances
    model = gw.call("PATCH", model_path(args.name), body)
    print(f"{model['name']}: keep-alive {keep_alive_text(model.get('keep_alive_s'))}, "
          f"min instances {model.get('min_instances', 0)}", file=out)
    return 0


def instances_text(instances: list[dict[str, Any]]) -> str:
    rows = [[i["instance_id"], i["node_id"], i["status"], str(i.get("batch_size", 0))]
            for i in instances]
    return table(rows, ["INSTANCE", "NODE", "STATUS", "REQUESTS"]) if rows else "no instances"


def cmd_load(gw: Gateway, args: argparse.Namespace, out: TextIO) -> int:
    body = {} if args.keep_alive is None else {"keep_alive": args.keep_alive}
    answer = gw.call("POST", model_path(args.name) + "/preload", body)
    print(f"loaded {args.name}", file=out)
    print(instances_text(answer.get("instances", [])), file=out)
    return 0


def cmd_unload(gw: Gateway, args: argparse.Namespace, out: TextIO) -> int:
    answer = gw.call("POST", model_path(args.name) + "/unload")
    left = answer.get("instances", [])
    print(f"unloading {args.name}" + (f"; {len(left)} instance(s) after their requests end"
                                      if left else ""), file=out)
    return 0


def cmd_alias(gw: Gateway, args: argparse.Namespace, out: TextIO) -> int:
    if args.rm:
        gw.call("DELETE", "/admin/aliases/" + quote(args.rm, safe="/"))
        print(f"removed alias {args.rm}", file=out)
        return 0
    if args.model is None:  # no model, no --rm: list them
        aliases = gw.call("GET", "/admin/aliases")["data"]
        rows = [[a["id"], a["model"], a["owned_by"]] for a in aliases]
        print(table(rows, ["ALIAS", "MODEL", "OWNER"]) if rows else "no aliases", file=out)
        return 0
    alias = gw.call("POST", model_path(args.model) + "/aliases", {"alias": args.alias})
    print(f"{alias['id']} -> {alias['model']}", file=out)
    return 0


# --- arguments --------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="slinfer models",
                                description="Register, list, inspect, alias and delete models "
                                            "through a gateway's admin API.")
    p.add_argument("--url", default=os.environ.get("SLINFER_URL", DEFAULT_URL),
                   help=f"the gateway (default: $SLINFER_URL or {DEFAULT_URL})")
    p.add_argument("--key", default=os.environ.get("SLINFER_API_KEY"),
                   help="API key, a tenant's or the operator's (default: $SLINFER_API_KEY)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    add = sub.add_parser("add", help="register a model directory (starts its conversion and "
                                     "profiling)")
    add.add_argument("name", help="the name requests will call it by")
    add.add_argument("path", help="its Hugging Face directory, on the gateway's and nodes' "
                                  "filesystem")
    add.add_argument("--engine", choices=["torch", "openvino", "vllm"], default="torch")
    add.add_argument("--slo-class", default="standard")
    add.add_argument("--public", action="store_true", help="every tenant sees it (operator only)")
    add.add_argument("--base-model", help="the model this LoRA adapter applies to")
    add.add_argument("--replace", action="store_true", help="overwrite your model of that name")
    add.add_argument("--wait", action="store_true",
                     help="print progress until the model is ready or failed")
    add.add_argument("--timeout", type=float, default=1800.0, help="--wait gives up after this "
                     "many seconds (default 1800)")
    add.add_argument("--interval", type=float, default=1.0, help=argparse.SUPPRESS)
    _serving_flags(add)
    add.set_defaults(run=cmd_add)

    set_ = sub.add_parser("set", help="change a model's keep-alive or minimum of warm instances")
    set_.add_argument("name")
    _serving_flags(set_, default_ok=True)
    set_.set_defaults(run=cmd_set)

    load = sub.add_parser("load", help="start an instance of a model now (where a request would "
                                       "go), or keep a warm one")
    load.add_argument("name")
    load.add_argument("--keep-alive", help="its keep-alive from now on (as a request's)")
    load.set_defaults(run=cmd_load)

    unload = sub.add_parser("unload", help="unload a model's instances now (busy ones when "
                                           "their requests end)")
    unload.add_argument("name")
    unload.set_defaults(run=cmd_unload)

    ls = sub.add_parser("list", help="the models you may see, with state and aliases")
    ls.add_argument("--json", action="store_true", help="the admin API's records as JSON")
    ls.set_defaults(run=cmd_list)

    status = sub.add_parser("status", help="one model's lifecycle per hardware kind")
    status.add_argument("name")
    status.add_argument("--json", action="store_true", help="the admin API's record as JSON")
    status.set_defaults(run=cmd_status)

    rm = sub.add_parser("rm", help="delete a model (and its aliases)")
    rm.add_argument("name")
    rm.set_defaults(run=cmd_rm)

    alias = sub.add_parser("alias", help="MODEL ALIAS: call MODEL also ALIAS; --rm ALIAS removes "
                                         "one; no arguments lists them")
    alias.add_argument("model", nargs="?")
    alias.add_argument("alias", nargs="?")
    alias.add_argument("--rm", metavar="ALIAS", help="remove this alias (its model stays)")
    alias.set_defaults(run=cmd_alias)
    return p


def _serving_flags(p: argparse.ArgumentParser, default_ok: bool = False) -> None:
    default = "; `default`: the cluster's" if default_ok else ""
    p.add_argument("--keep-alive", help="how long an idle instance stays loaded: seconds or a "
                   f"duration (5m, 1h, 30s); 0: unload when idle; negative: never{default}")
    p.add_argument("--min-instances", type=int, help="warm instances the cluster keeps (pinned: "
                   "never unloaded as idle)")


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """Parsed arguments; SystemExit(2) with a usage message for bad ones (argparse's way)."""
    p = parser()
    args = p.parse_args(list(argv))
    if args.command == "set" and args.keep_alive is None and args.min_instances is None:
        p.error("set: give --keep-alive and/or --min-instances")
    if args.command == "alias":
        if args.rm and args.model:
            p.error("alias: give MODEL ALIAS or --rm ALIAS, not both")
        if args.model is not None and args.alias is None:
            p.error("alias: MODEL needs the ALIAS to add (or --rm ALIAS)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:  # --help (0) or a usage error (2): argparse printed it
        return exc.code if isinstance(exc.code, int) else 2
    gw = Gateway(args.url, args.key)
    try:
        return args.run(gw, args, sys.stdout)
    except CliError as exc:
        print(f"slinfer models: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
