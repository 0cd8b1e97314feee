"""Timing profiles and node shapes for the paper's testbed (SLINFER §IX-A).

Hardware: a 32-core Intel Xeon 6462C (4th-gen, AMX) CPU node and an NVIDIA A100-80GB GPU node.
Models: Llama-3.2-3B, Llama-2-7B, Llama-2-13B in 16-bit precision.

Every profile is a `shared.core.perf_model.Profile` (the same tables the profiler writes), built
from small closed-form cost models whose coefficients come from the papers where they publish a
number and from first principles where they do not. The sources are written next to each number.

CPU (compute-bound prefill, bandwidth-bound decode), fitted to SLINFER Table I (Llama-2-7B on the
4th-gen Xeon) and scaled to other model sizes by what each term is proportional to:
    prefill(L)   = g + e*L + f*L^2          (g fixed, e ~ parameters, f ~ layers*hidden)
    decode(b, L) = a + c*b + d*b*L          (a ~ weight bytes, c ~ parameters, d ~ KV bytes/token)
The 7B fit reproduces Table I within 1%, Table II's CPU concurrency limits (27 at 2K, 15 at 4K,
9 and 4 for half a node), §IV's "batch 9 at 1K / 3 at 4K under 100 ms", and, scaled by size, the
§IX-A DeepSeek-R1-Distill-Qwen-7B numbers (650 ms / 74 ms) and §IV's 13B 8 s TTFT limit (~5.6K);
tests/sim/test_profiles.py checks all of these.

GPU (no per-model numbers in the paper): roofline with efficiency factors,
    prefill(L)   = o_p + (2*P*L + 4*layers*hidden*L^2) / (peak * eta_c)
    decode(b, L) = o_d + (W + b*L*C) / (BW * eta_bw) + 2*P*b / (peak * eta_c)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from shared.core.perf_model import DecodeTable, PerfModel, PrefillTable, Profile
from shared.core.types import Hardware, ModelSpec, NodeView
from shared.wire import from_plain, to_plain

GB = 10**9
GiB = 2**30


@dataclass(frozen=True)
class ModelShape:
    """The architecture numbers that set weight bytes, KV bytes and FLOPs (from each model's
    Hugging Face config.json)."""

    name: str
    params: float  # parameter count
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    max_context: int  # served max_model_len (see MAX_CONTEXT)
    dtype_bytes: int = 2  # 16-bit weights and KV (§IX-A)

    @property
    def weight_bytes(self) -> int:
        return int(self.params * self.dtype_bytes)

    @property
    def kv_bytes_per_token(self) -> int:
        # K and V, every layer, every KV head: 2 * layers * kv_heads * head_dim * 2 bytes
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def attn_width(self) -> int:
        return self.layers * self.hidden  # attention FLOPs per token pair scale with this


# Llama-2 has a 4K context; Llama-3.2-3B supports 128K, but we serve it with max_model_len 4096
# too so all three sizes see the same sampled requests and the same eq. 2 floor (L_min).
MAX_CONTEXT = 4096

SHAPES: dict[str, ModelShape] = {
    # meta-llama/Llama-3.2-3B config.json: 28 layers, hidden 3072, 8 KV heads x 128 (GQA), 3.21B.
    "3b": ModelShape("llama-3.2-3b", 3.21e9, 28, 3072, 8, 128, MAX_CONTEXT),
    # meta-llama/Llama-2-7b-hf: 32 layers, hidden 4096, 32 KV heads x 128 (MHA), 6.74B.
    "7b": ModelShape("llama-2-7b", 6.74e9, 32, 4096, 32, 128, MAX_CONTEXT),
    # meta-llama/Llama-2-13b-hf: 40 layers, hidden 5120, 40 KV heads x 128 (MHA), 13.02B.
    "13b": ModelShape("llama-2-13b", 13.02e9, 40, 5120, 40, 128, MAX_CONTEXT),
}
# Used only to check the size scaling against §IX-A: deepseek-ai/DeepSeek-R1-Distill-Qwen-7B,
# 28 layers, hidden 3584, 4 KV heads x 128, 7.62B parameters.
DEEPSEEK_7B = ModelShape("deepseek-r1-distill-qwen-7b", 7.62e9, 28, 3584, 4, 128, MAX_CONTEXT)

# Mean output length of the Azure conversation trace (shared/traces/README.md: 211 tokens);
# this is Ō of eq. 2 ("from historical logs").
AVG_OUTPUT_LEN = 211.0

# ---------------------------------------------------------------------------------------------
# CPU node: 32-core Xeon 6462C @3.3 GHz with AMX.
CPU_REF = SHAPES["7b"]  # Table I is measured on Llama-2-7B
# Least-squares fits to SLINFER Table I, 4th-gen row (TTFT 149/567/2748 ms at 256/1K/4K;
# TPOT 71/196/80/459 ms at bs1-1K, bs32-1K, bs1-4K, bs32-4K). Exact solve for prefill.
CPU_PREFILL_G = 0.02098  # s, fixed per prefill
CPU_PREFILL_E = 4.8904e-4  # s per input token (7B)
CPU_PREFILL_F = 4.3148e-8  # s per input token^2 (7B attention)
CPU_DECODE_A = 0.06737  # s per iteration: streaming 13.5 GB of weights (7B)
CPU_DECODE_C = 1.2794e-3  # s per request in the batch (7B)
CPU_DECODE_D = 2.6756e-6  # s per context token in the batch (7B KV read)
# First-principles cross-checks of the fit (not used in the tables):
# - 8-channel DDR5-4800 = 8 * 38.4 GB/s = 307 GB/s; 13.48 GB / 307 GB/s = 44 ms vs a = 67 ms
#   (66% of peak bandwidth); 512 KB/token / 307 GB/s = 1.7 us vs d = 2.7 us (64%).
# - §X: 105 TFLOPS bf16 AMX; 2 * 6.74e9 * 1024 FLOP / 105 TFLOPS = 0.13 s vs 0.57 s at 1K (23%).
CPU_MEMORY_BYTES = 128 * GiB  # ASSUMPTION: the paper does not state it; a socket of a 2-socket
# server with 256+ GB. The CPU is compute-bound long before this fills (7B: ~230K tokens of KV).

# ---------------------------------------------------------------------------------------------
# GPU node: NVIDIA A100-80GB SXM.
A100_HBM_BYTES_PER_S = 2.0e12  # A100-80GB datasheet: 2,039 GB/s HBM2e
A100_PEAK_FLOPS = 312e12  # A100 datasheet: 312 TFLOPS dense bf16 tensor core
GPU_ETA_BW = 0.70  # ASSUMPTION: achievable share of HBM bandwidth in decode GEMV/attention
GPU_ETA_C = 0.60  # ASSUMPTION: achievable share of tensor-core peak in prefill GEMM
GPU_OVERHEAD_DECODE = 0.003  # s, ASSUMPTION: per-iteration launch + scheduler overhead
GPU_OVERHEAD_PREFILL = 0.005  # s, ASSUMPTION
# 7B bs1 decode = 3 ms + 13.48 GB / 1.4 TB/s = 12.6 ms, in line with vLLM's ~12-13 ms on A100.
GPU_MEMORY_BYTES = 80 * GiB  # A100-80GB has 81,920 MiB of HBM. Table II's GPU limits (7B: 66 at
# 2K, 32 at 4K) match the whole of it holding weights + KV: (80 GiB - 13.5 GB) / 512 KiB per
# token = 138K tokens = 67 x 2K = 33 x 4K.

# ---------------------------------------------------------------------------------------------
# Cold start and KV scaling.
# ServerlessLLM's loader: "1 second to load a 7B model in our environment" (SLINFER §IX-A),
# i.e. 13.48 GB/s; other sizes scale with weight bytes (the loader is bandwidth-bound,
# ServerlessLLM §6.1: load time = q + n/b). Same on CPU nodes: "All models are cached in CPU
# memory, and the cold-start procedure is similar across all systems" (§IX-A).
LOAD_BYTES_PER_S = SHAPES["7b"].weight_bytes / 1.0
# KV resize (SLINFER Fig. 17, A100): 32->16 GB takes 0.3 s, 32->64 GB takes 1.9 s. The core's
# cost model is fixed + bytes_after / rate; one rate through both points in total
# ((16+64) GB / (0.3+1.9) s = 36.4 GB/s) gives 0.44 s and 1.76 s. No CPU figure is published;
# we use the same rate (allocation, not bandwidth, dominates).
KV_SCALE_FIXED_S = 0.0
KV_SCALE_BYTES_PER_S = (16 + 64) * GB / (0.3 + 1.9)

PREFILL_LENGTHS = [2**k for k in range(4, 15)]  # 16 .. 16384 (profiler grid: 2^k)
DECODE_BATCHES = [2**i for i in range(0, 10)]  # 1 .. 512
DECODE_LENGTHS = [2**j for j in range(4, 15)]  # 16 .. 16384


def cpu_prefill_s(shape: ModelShape, length: float) -> float:
    e = CPU_PREFILL_E * shape.params / CPU_REF.params
    f = CPU_PREFILL_F * shape.attn_width / CPU_REF.attn_width
    return CPU_PREFILL_G + e * length + f * length * length


def cpu_decode_s(shape: ModelShape, batch: float, avg_len: float) -> float:
    a = CPU_DECODE_A * shape.weight_bytes / CPU_REF.weight_bytes
    c = CPU_DECODE_C * shape.params / CPU_REF.params
    d = CPU_DECODE_D * shape.kv_bytes_per_token / CPU_REF.kv_bytes_per_token
    return a + c * batch + d * batch * avg_len


def gpu_prefill_s(shape: ModelShape, length: float) -> float:
    flops = 2 * shape.params * length + 4 * shape.attn_width * length * length
    return GPU_OVERHEAD_PREFILL + flops / (A100_PEAK_FLOPS * GPU_ETA_C)


def gpu_decode_s(shape: ModelShape, batch: float, avg_len: float) -> float:
    bytes_read = shape.weight_bytes + batch * avg_len * shape.kv_bytes_per_token
    flops = 2 * shape.params * batch
    return (GPU_OVERHEAD_DECODE + bytes_read / (A100_HBM_BYTES_PER_S * GPU_ETA_BW)
            + flops / (A100_PEAK_FLOPS * GPU_ETA_C))


def load_s(shape: ModelShape) -> float:
    return shape.weight_bytes / LOAD_BYTES_PER_S


def _profile(shape: ModelShape, hw: Hardware, prefill, decode, source: str) -> Profile:
    return Profile(
        model=shape.name,
        hardware=hw,
        prefill=PrefillTable(PREFILL_LENGTHS, [prefill(shape, n) for n in PREFILL_LENGTHS]),
        decode=DecodeTable(DECODE_BATCHES, DECODE_LENGTHS,
                           [[decode(shape, b, n) for n in DECODE_LENGTHS] for b in DECODE_BATCHES]),
        load_s=load_s(shape),
        kv_scale_fixed_s=KV_SCALE_FIXED_S,
        kv_scale_bytes_per_s=KV_SCALE_BYTES_PER_S,
        source=source,
    )


def cpu_profile(shape: ModelShape) -> Profile:
    return _profile(shape, Hardware.CPU, cpu_prefill_s, cpu_decode_s,
                    "SLINFER Table I (Xeon 6462C, Llama-2-7B) fit, scaled by model shape")


def gpu_profile(shape: ModelShape) -> Profile:
    return _profile(shape, Hardware.GPU, gpu_prefill_s, gpu_decode_s,
                    "A100-80GB roofline: 2.0 TB/s HBM, 312 TFLOPS bf16, eta 0.7/0.6")


def model_spec(shape: ModelShape, name: str | None = None) -> ModelSpec:
    """A ModelSpec for one deployed model (replicas of a base share its shape and profiles)."""
    return ModelSpec(name=name or shape.name, weight_bytes=shape.weight_bytes,
                     kv_bytes_per_token=shape.kv_bytes_per_token,
                     max_context=shape.max_context, avg_output_len=AVG_OUTPUT_LEN)


def builtin_profiles() -> dict[tuple[str, Hardware], Profile]:
    out: dict[tuple[str, Hardware], Profile] = {}
    for shape in SHAPES.values():
        out[(shape.name, Hardware.CPU)] = cpu_profile(shape)
        out[(shape.name, Hardware.GPU)] = gpu_profile(shape)
    return out


def load_profiles(path: str | Path) -> list[Profile]:
    """Profiles measured by the profiler: a JSON object or list of objects with Profile's fields
    (`{"model", "hardware", "prefill": {"lengths", "seconds"}, "decode": {"batch_sizes",
    "lengths", "seconds"}, "load_s", ...}`) -- what `shared.wire.to_plain(profile)` writes."""
    data = json.loads(Path(path).read_text())
    items = data if isinstance(data, list) else data.get("profiles", [data])
    return [from_plain(Profile, item) for item in items]


def dump_profiles(profiles: list[Profile], path: str | Path) -> None:
    Path(path).write_text(json.dumps([to_plain(p) for p in profiles], indent=1, sort_keys=True))


@dataclass
class ProfileBook:
    """Profiles by base model shape; per-model replicas map to their base's profiles."""

    by_base: dict[tuple[str, Hardware], Profile]

    def perf_model(self, model_to_base: dict[str, str]) -> PerfModel:
        """One PerfModel holding a copy (same tables, renamed) for every deployed model."""
        perf = PerfModel()
        for model, base in sorted(model_to_base.items()):
            for hw in (Hardware.CPU, Hardware.GPU):
                p = self.by_base.get((base, hw))
                if p is not None:
                    perf.add(replace(p, model=model))
        return perf

    def override(self, measured: list[Profile]) -> None:
        for p in measured:
            self.by_base[(p.model, p.hardware)] = p


def node_view(node_id: str, hw: Hardware) -> NodeView:
    mem = CPU_MEMORY_BYTES if hw is Hardware.CPU else GPU_MEMORY_BYTES
    return NodeView(node_id=node_id, hardware=hw, memory_bytes=mem, matrix_accel=True)
