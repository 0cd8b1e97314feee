"""LoRA adapters applied unmerged over a shared backbone (ServerlessLoRA §4.4, S-LoRA, Punica).

The backbone's weights are never touched: for every projection an adapter targets, the engine
computes `y = W x + scale · B (A x)` with that request's adapter, so one copy of the backbone
serves any mix of adapters and plain base requests in one batch.

- `read_adapter` turns a PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`
  or `.bin`) into a `LoraAdapter`: per (layer, projection) the A [r, in] and B [out, r] matrices
  and the scale (lora_alpha / r, or / sqrt(r) with rsLoRA), in the backbone's dtype and device.
  What the engine cannot apply exactly (DoRA, bias training, modules_to_save, embeddings or the
  LM head as targets, per-module rank/alpha patterns) is refused with a ValueError, never
  silently ignored.
- `LoraBatch` is what one iteration applies: the batch's rows grouped into contiguous segments
  that share an adapter (the engine orders a decode batch by adapter first), and for each
  segment two matmuls on that segment's rows only (Punica's SGMV, "segmented gather
  matrix-vector", in plain torch: every adapter's weights are read once per step however many of
  its requests are in the batch, and rows without an adapter cost nothing).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

ADAPTER_CONFIG = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = ATTENTION + MLP

# peft's saved keys: base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (older
# versions may keep the adapter's name before .weight).
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\."
                  r"(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass(frozen=True)
class LoraWeights:
    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]
    scale: float  # lora_alpha / rank (rsLoRA: / sqrt(rank))


@dataclass
class LoraAdapter:
    name: str
    path: Path
    rank: int
    weights: dict[tuple[int, str], LoraWeights] = field(default_factory=dict)  # (layer, proj)

    @property
    def nbytes(self) -> int:
        """Bytes its A and B matrices hold on the device (all an adapter adds to a backbone)."""
        return sum(w.a.nbytes + w.b.nbytes for w in self.weights.values())


def projection_shapes(config) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection of one layer of a Llama/Qwen2 config."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_out = config.num_attention_heads * head_dim
    kv_out = config.num_key_value_heads * head_dim
    return {"q_proj": (hidden, q_out), "k_proj": (hidden, kv_out), "v_proj": (hidden, kv_out),
            "o_proj": (q_out, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def read_adapter(name: str, path: str | Path, config, device: torch.device,
                 dtype: torch.dtype) -> LoraAdapter:
    """Load and validate a PEFT LoRA adapter for a backbone with this HF `config`."""
    path = Path(path)
    settings = _adapter_config(path)
    tensors = _adapter_tensors(path)
    use_rslora = bool(settings.get("use_rslora"))
    alpha = settings.get("lora_alpha", settings.get("r", 8))
    if not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"{path}: lora_alpha must be a positive number, got {alpha!r}")
    shapes = projection_shapes(config)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"{path}: cannot apply {key!r} (only the lora_A/lora_B matrices "
                             f"of a layer's {', '.join(PROJECTIONS)} are supported)")
        layer, block, proj, which = int(match[1]), match[2], match[3], match[4]
        if proj not in PROJECTIONS or (block == "mlp") != (proj in MLP):
            raise ValueError(f"{path}: {key!r} targets an unsupported module")
        if layer >= config.num_hidden_layers:
            raise ValueError(f"{path}: {key!r} names layer {layer}; the base has "
                             f"{config.num_hidden_layers}")
        pairs.setdefault((layer, proj), {})[which] = tensor
    if not pairs:
        raise ValueError(f"{path}: the adapter holds no LoRA weights")
    adapter = LoraAdapter(name, path, rank=0)
    for (layer, proj), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{path}: layer {layer} {proj} lacks lora_{'AB'[len(pair) - 1]}")
        a, b = pair["A"], pair["B"]
        fan_in, fan_out = shapes[proj]
        rank = a.shape[0]
        if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
            raise ValueError(f"{path}: layer {layer} {proj}: A {tuple(a.shape)} and B "
                             f"{tuple(b.shape)} do not fit the base's {fan_in} -> {fan_out} "
                             f"(is it an adapter of another model?)")
        scale = alpha / (math.sqrt(rank) if use_rslora else rank)
        adapter.weights[(layer, proj)] = LoraWeights(
            a.to(device=device, dtype=dtype).contiguous(),
            b.to(device=device, dtype=dtype).contiguous(), float(scale))
        adapter.rank = max(adapter.rank, rank)
    return adapter


def _adapter_config(path: Path) -> dict:
    try:
        settings = json.loads((path / ADAPTER_CONFIG).read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} has no {ADAPTER_CONFIG} (not a PEFT adapter)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}/{ADAPTER_CONFIG} is unreadable: {exc}") from None
    if not isinstance(settings, dict):
        raise ValueError(f"{path}/{ADAPTER_CONFIG} is not a JSON object")
    peft_type = str(settings.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"{path}: peft_type {peft_type} is not LoRA")
    unsupported = [
        ("use_dora", settings.get("use_dora")), ("modules_to_save", settings.get("modules_to_save")),
        ("rank_pattern", settings.get("rank_pattern")),
        ("alpha_pattern", settings.get("alpha_pattern")),
        ("fan_in_fan_out", settings.get("fan_in_fan_out")),
        ("lora_bias", settings.get("lora_bias")),
        ("layer_replication", settings.get("layer_replication")),
    ]
    if settings.get("bias", "none") != "none":
        unsupported.append(("bias", settings["bias"]))
    if bad := [k for k, v in unsupported if v]:
        raise ValueError(f"{path}: the torch engine cannot apply adapters with {', '.join(bad)}")
    return settings


def _adapter_tensors(path: Path) -> dict[str, torch.Tensor]:
    for file_name in WEIGHT_FILES:
        file = path / file_name
        if not file.is_file():
            continue
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(file))
        state = torch.load(file, map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise ValueError(f"{file} does not hold a state dict")
        return state
    raise ValueError(f"{path} has none of {', '.join(WEIGHT_FILES)}")


@dataclass(frozen=True)
class LoraBatch:
    """The adapters of one iteration's rows: (start, end, adapter) segments over the batch
    dimension, rows [start, end) sharing `adapter`; rows in no segment run the plain base."""

    segments: tuple[tuple[int, int, LoraAdapter], ...]

    @classmethod
    def of_rows(cls, adapters: list[LoraAdapter | None]) -> LoraBatch | None:
        """The segments of rows already grouped by adapter; None when no row has one."""
        segments = []
        start = 0
        for i in range(1, len(adapters) + 1):
            if i == len(adapters) or adapters[i] is not adapters[start]:
                if adapters[start] is not None:
                    segments.append((start, i, adapters[start]))
                start = i
        return cls(tuple(segments)) if segments else None

    def apply(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Add each segment's `scale · B (A x)` to its rows of y (= W x), in place."""
        for start, end, adapter in self.segments:
            w = adapter.weights.get((layer, proj))
            if w is None:
                continue
            xs = x[start:end].reshape(-1, x.shape[-1])
            ys = y[start:end].view(-1, y.shape[-1])  # a view: the add lands in y
            ys.addmm_(xs @ w.a.t(), w.b.t(), alpha=w.scale)
        return y


def group_by_adapter(adapters: list[str | None]) -> list[int]:
    """A stable order of batch rows that puts the rows of each adapter next to each other (base
    rows first), so `LoraBatch.of_rows` finds one segment per adapter."""
    return sorted(range(len(adapters)), key=lambda i: (adapters[i] is not None, adapters[i] or ""))
