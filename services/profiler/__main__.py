"""`slinfer profile`: measure prefill/decode tables for a model and store them (JSON + Redis)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from services.profiler.measure import ProfilePlan
from services.profiler.run import profile_model, write_report
from shared.settings import env_str


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="slinfer profile", description=__doc__)
    p.add_argument("--model", required=True, type=Path, help="Hugging Face model directory")
    p.add_argument("--name", help="registered model name (default: the directory name)")
    p.add_argument("--engine", default="torch", choices=["torch", "openvino", "vllm"])
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--max-len", type=int, default=1024, help="largest input length sampled (2^k)")
    p.add_argument("--max-batch", type=int, default=32, help="largest batch size sampled (2^i)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--passes", type=int, default=2,
                   help="separate sweeps of the decode grid (samples of a point spread in time)")
    p.add_argument("--lora-ranks", default="8,32",
                   help="adapter ranks whose unmerged-LoRA cost is measured (torch engine; "
                        "comma-separated, empty: none)")
    p.add_argument("--check", type=int, default=0, metavar="N",
                   help="replay N random workloads and report the mean relative error")
    p.add_argument("--out", type=Path, help="write the tables (and check errors) as JSON here")
    p.add_argument("--redis", default=env_str("SLINFER_REDIS_URL", ""),
                   help="store the profile in this Redis (default: $SLINFER_REDIS_URL; empty: skip)")
    return p.parse_args(argv)


async def _store(url: str, profile) -> None:
    from shared.cluster import save_profile
    from shared.redis_client import open_redis

    redis = open_redis(url)
    try:
        await save_profile(redis, profile)
    finally:
        await redis.aclose()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not (args.model / "config.json").exists():
        print(f"error: {args.model} is not a Hugging Face model directory", file=sys.stderr)
        return 2
    try:
        ranks = tuple(sorted({int(r) for r in args.lora_ranks.split(",") if r.strip()}))
    except ValueError:
        print(f"error: --lora-ranks must be comma-separated integers, not {args.lora_ranks!r}",
              file=sys.stderr)
        return 2
    if any(r < 1 for r in ranks):
        print("error: --lora-ranks must be positive", file=sys.stderr)
        return 2
    plan = ProfilePlan(max_len=args.max_len, max_batch=args.max_batch, repeats=args.repeats,
                       warmup=args.warmup, passes=args.passes, lora_ranks=ranks)
    name = args.name or args.model.name
    try:
        profile, result = profile_model(args.model, name, args.engine, args.device, plan,
                                        args.check, progress=True)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.out:
        write_report(args.out, profile, result)
        print(f"wrote {args.out}")
    if args.redis:
        asyncio.run(_store(args.redis, profile))
        print(f"stored profile {name}|{profile.hardware.value} in {args.redis}")
    if result is not None:
        print(f"check over {result.samples} workloads: TTFT error {result.ttft_mean_rel_error:.1%}, "
              f"TPOT error {result.tpot_mean_rel_error:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
