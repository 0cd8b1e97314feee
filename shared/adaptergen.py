"""Random-weight PEFT LoRA adapters for a generated base model, offline.

`slinfer make-adapter --base DIR --out DIR [--rank 8] [--alpha 16] [--seed 1]` writes what
`peft.PeftModel.from_pretrained(base_model, DIR)` loads: `adapter_config.json` (peft_type LORA,
task CAUSAL_LM) and `adapter_model.safetensors` with the `lora_A` / `lora_B` weights of the
target projections of every layer, under peft's saved key names
(`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`).

Unlike a freshly initialised peft adapter (B = 0, the identity), both A and B are drawn
(seeded, normal), so an adapter really changes the model's output and two seeds give two
different functions. The base is only read for its config.json: nothing is loaded.
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from pathlib import Path

import torch

# The linear projections of a Llama / Qwen2 layer that an adapter may target, and where they are.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = ATTENTION_PROJECTIONS + MLP_PROJECTIONS
DEFAULT_TARGETS = PROJECTIONS
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection of one layer, from a config.json dict."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads") or heads
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    return {"q_proj": (hidden, q_out), "k_proj": (hidden, kv_out), "v_proj": (hidden, kv_out),
            "o_proj": (q_out, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def module_path(layer: int, projection: str) -> str:
    """The projection's module path inside a *ForCausalLM model."""
    block = "self_attn" if projection in ATTENTION_PROJECTIONS else "mlp"
    return f"model.layers.{layer}.{block}.{projection}"


def build_adapter(base_dir: Path, out_dir: Path, *, rank: int = 8, alpha: float = 16.0,
                  targets: tuple[str, ...] = DEFAULT_TARGETS, seed: int = 1,
                  std: float | None = None, dtype: str | None = None) -> Path:
    """Write a random LoRA adapter for the model in `base_dir` into `out_dir`.

    `std` is the standard deviation of A and B (default: the base's initializer_range, so the
    update B·A is a visible fraction of the base weights); `dtype` defaults to the base's."""
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    config = json.loads((base_dir / "config.json").read_text())
    if rank < 1:
        raise ValueError("rank must be >= 1")
    if unknown := [t for t in targets if t not in PROJECTIONS]:
        raise ValueError(f"unknown target modules {unknown}; choose among {PROJECTIONS}")
    if not targets:
        raise ValueError("an adapter needs at least one target module")
    dtype = dtype or config.get("dtype") or config.get("torch_dtype") or "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    std = float(config.get("initializer_range", 0.02)) if std is None else std
    shapes = projection_shapes(config)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for projection in targets:
            fan_in, fan_out = shapes[projection]
            key = f"base_model.model.{module_path(layer, projection)}"
            tensors[f"{key}.lora_A.weight"] = _normal((rank, fan_in), std, seed, f"{key}.A", dtype)
            tensors[f"{key}.lora_B.weight"] = _normal((fan_out, rank), std, seed, f"{key}.B", dtype)
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_dir),
        "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": sorted(targets),
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "init_lora_weights": True, "inference_mode": True,
        "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None,
    }
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2) + "\n")
    return out_dir


def _normal(shape: tuple[int, int], std: float, seed: int, name: str, dtype: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return (torch.randn(shape, generator=generator) * std).to(DTYPES[dtype])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="slinfer make-adapter",
        description="Write a random-weight PEFT LoRA adapter for a (generated) base model.")
    parser.add_argument("--base", required=True, type=Path, help="the base model's directory")
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                        help=f"comma-separated projections (default: all of {PROJECTIONS})")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--std", type=float, help="std of A and B (default: the base's "
                                                  "initializer_range)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: the base's dtype")
    args = parser.parse_args(argv)
    targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    path = build_adapter(args.base, args.out, rank=args.rank, alpha=args.alpha, targets=targets,
                         seed=args.seed, std=args.std, dtype=args.dtype)
    print(f"built a rank-{args.rank} LoRA adapter (seed {args.seed}) for {args.base} in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
