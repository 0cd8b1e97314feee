"""`slinfer <command> [args...]`: one entry point for every service and tool.

Each command lives in its own module with a `main(argv) -> int`; it is imported only when its
command runs, so `slinfer --help` stays fast and one broken service cannot break the others.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    module: str  # module holding `main(argv: list[str]) -> int`
    summary: str  # one line for `slinfer --help`


COMMANDS: dict[str, Command] = {
    "up": Command("services.launcher", "run the whole local stack (NATS, Redis, placer, nodes, gateway)"),
    "models": Command("services.models_cli",
                      "add, list, inspect, alias and delete models on a running gateway"),
    "gateway": Command("services.gateway.__main__", "OpenAI-compatible HTTP gateway and admin API"),
    "placer": Command("services.placer.__main__", "placement service: consumes the request stream"),
    "node": Command("services.node.__main__", "node worker: runs engine instances on one CPU/GPU node"),
    "make-model": Command("shared.modelgen", "build a random-weight model and tokenizer offline"),
    "fetch-model": Command("shared.default_model",
                           "download and convert the default model (SmolLM2-135M-Instruct) once"),
    "make-adapter": Command("shared.adaptergen",
                            "build a random-weight PEFT LoRA adapter for a model offline"),
    "profile": Command("services.profiler.__main__", "measure prefill/decode tables for a model"),
    "profiler": Command("services.profiler.service",
                        "profiling service: makes registered models servable (convert, profile)"),
    "simulate": Command("sim.cli", "discrete-event cluster simulation with the real policy core"),
    "convert-openvino": Command("services.node.engines.openvino_engine",
                                "convert a HF model directory to OpenVINO IR (cached)"),
    "convert-checkpoint": Command("services.node.loader.convert",
                                  "convert a HF checkpoint to the fast-loading format (once)"),
}


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: slinfer <command> [args...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {cmd.summary}" for name, cmd in COMMANDS.items()]
    lines += ["", "`slinfer <command> --help` shows the options of one command."]
    return "\n".join(lines)


class CommandUnavailable(RuntimeError):
    pass


def load(name: str) -> Callable[[list[str]], int]:
    """Import the command's module and return its `main`; CommandUnavailable says why not."""
    module_name = COMMANDS[name].module
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise CommandUnavailable(
                f"`slinfer {name}` is not available: module {module_name} does not exist "
                "in this installation") from exc
        raise CommandUnavailable(
            f"`slinfer {name}` cannot start: {module_name} needs the Python module "
            f"{exc.name!r}, which is not installed (run `make install`)") from exc
    main = getattr(module, "main", None)
    if not callable(main):
        raise CommandUnavailable(f"`slinfer {name}`: {module_name} has no main(argv) function")
    return main


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"slinfer: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    try:
        command_main = load(name)
    except CommandUnavailable as exc:
        print(f"slinfer: {exc}", file=sys.stderr)
        return 2
    result = command_main(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
