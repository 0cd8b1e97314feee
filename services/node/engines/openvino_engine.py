"""OpenVINO engine: OpenVINO GenAI's `ContinuousBatchingPipeline` behind the engine protocol.

The pipeline owns the model, a paged KV cache and its own scheduler; what we can drive is
`add_request` (a token tensor) and `step()` (one scheduler iteration). The protocol maps onto it
like this; where the pipeline cannot do exactly what the protocol says, it is written here.

* **prefill(id) runs alone.** A request enters the pipeline only when its prefill is asked for, and
  the pipeline is built with `dynamic_split_fuse=False` (the vLLM-style scheduler): a step that
  schedules a prompt schedules no decode. So the step after `add_request` is that prompt alone and
  yields its first token. `max_num_batched_tokens` is the model's context, so a prompt is never
  split.
* **decode(ids) is one step of every running request.** The pipeline cannot pause a sequence: each
  step decodes all of them. The node scheduler always names the whole batch, and then this is
  exact. When a caller names a strict subset, the others still advance; their tokens wait in a
  per-request queue ("ahead" tokens) and are handed out, in order, by later decodes that name
  them (a decode whose requests all have a queued token does not step the pipeline). Outputs stay
  identical; the left-out requests ran early and hold KV for those tokens.
* **release / evict** cancel the request's handle. The pipeline frees a cancelled request's KV
  blocks only at the end of its next step, after that step was scheduled, so until then they
  count as used in `memory()`. With no other request running, the engine flushes them at once
  with an empty step. When the next iteration fits only without them (a pool at its edge right
  after a release), the engine rebuilds the pipeline at the same size (see resize) rather than
  let the pipeline preempt a live request or report a KVCacheFull the torch engine would not.
* **KVCacheFull.** The pipeline would preempt (recompute) a sequence when blocks run out; the
  engine checks free blocks itself before each step and raises KVCacheFull instead, leaving
  everything untouched, so the pipeline never preempts.
* **resize_kv rebuilds.** The KV pool size is fixed when the pipeline is built (`num_kv_blocks`).
  Resizing builds a new pipeline with the new block count, cancels every request in the old
  one, and re-adds each running request with all its tokens so far: one batched prompt step
  recomputes their KV cache (token-based recompute, as after a migration). That step also yields
  each request's next token, which goes into its ahead queue, so a recomputed request holds KV
  for one more token than before (up to one more block each; a shrink below that is refused
  with ValueError and nothing changes). Its cost: the compile of the new pipeline, the
  allocation of the new pool, and the recompute; `slinfer profile` measures it into
  `Profile.kv_scale_fixed_s` / `kv_scale_bytes_per_s`.

Precision: `dtype=None` keeps the plugin's defaults (on this CPU bf16 compute and a compressed KV
cache); "float32" asks for f32 compute and an f32 KV cache (use it to compare outputs),
"bfloat16"/"float16" for that type in both. KV bytes per token are read from the pipeline (its
reported pool size over its block count), not assumed.

Sampling: greedy at temperature 0 (argmax, as the torch engine); otherwise the pipeline's own
multinomial sampler with temperature, top-k, top-p and `rng_seed`; the pipeline's repetition
penalty and min_new_tokens (`_generation_config`). A seeded request is reproducible on a
fresh pipeline, but its random stream restarts when it is re-added (evict/resume or a resize), so
sampled (not greedy) continuations after those differ from an uninterrupted run.

Conversion: the pipeline reads OpenVINO IR, not a Hugging Face directory. `ensure_ir` converts
with optimum-intel's exporter, which runs in its own virtual environment (`.venv-openvino`, made
by `make install`: optimum-intel needs transformers < 5.6, the main environment has a newer one)
and caches the IR under `$SLINFER_OPENVINO_CACHE` (default `~/.cache/slinfer/openvino`), keyed
by a hash of the model directory's files and the export options. `load()` converts on first use;
`slinfer convert-openvino --model DIR [--out DIR]` (this module's `main`) does it ahead of time
with a progress bar.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from .base import (KVCacheFull, MemoryReport, PipelinedRequest, RequestBook, SamplingParams,
                   StepResult, blocks)

__all__ = ["OpenVINOEngine", "ensure_ir", "main"]

REPO_ROOT = Path(__file__).resolve().parents[3]
EXPORT_VENV = REPO_ROOT / ".venv-openvino"
BLOCK_SIZE = 32  # tokens per KV block of the CPU plugin's paged attention (checked by the tests)
DEFAULT_KV_TOKENS = 16384  # default pool: min(this, 4 x context length) tokens, as the torch engine
PRECISIONS = {  # dtype -> (INFERENCE_PRECISION_HINT, KV_CACHE_PRECISION)
    "float32": ("f32", "f32"),
    "bfloat16": ("bf16", "bf16"),
    "float16": ("f16", "f16"),
}
IR_MARKER = "slinfer-openvino.json"  # written last: the IR directory is complete
HASHED_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json")


# -- conversion ------------------------------------------------------------------------------------

def export_python() -> Path:
    """The interpreter of the exporter's environment ($SLINFER_OPENVINO_EXPORT_PYTHON or
    .venv-openvino at the repository root)."""
    override = os.environ.get("SLINFER_OPENVINO_EXPORT_PYTHON")
    return Path(override) if override else EXPORT_VENV / "bin" / "python"


def cache_root() -> Path:
    override = os.environ.get("SLINFER_OPENVINO_CACHE")
    return Path(override) if override else Path.home() / ".cache" / "slinfer" / "openvino"


def _weight_format(model_dir: Path) -> str:
    config = json.loads((model_dir / "config.json").read_text())
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    return "fp32" if dtype == "float32" else "fp16"


def model_key(model_dir: Path, weight_format: str) -> str:
    """Content hash of the model directory (config, tokenizer, weights) and export options."""
    digest = hashlib.sha256(f"slinfer-openvino-1|{weight_format}".encode())
    names = [n for n in HASHED_FILES if (model_dir / n).exists()]
    names += sorted(p.name for p in model_dir.glob("*.safetensors"))
    for name in names:
        digest.update(name.encode())
        with open(model_dir / name, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()[:24]


def ensure_ir(model_dir: str | Path, out_dir: str | Path | None = None,
              progress: bool = False) -> Path:
    """The OpenVINO IR of a Hugging Face directory: from the cache when present, else converted
    with optimum-intel (in its own environment) into a temporary directory and moved in place."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").exists():
        raise ValueError(f"{model_dir} is not a Hugging Face model directory")
    if (model_dir / "openvino_model.xml").exists():
        return model_dir  # already IR
    fmt = _weight_format(model_dir)
    from tqdm import tqdm

    bar = tqdm(total=3, desc=f"openvino IR of {model_dir.name}", unit="step",
               disable=not progress)
    try:
        bar.set_postfix_str("hashing")
        key = model_key(model_dir, fmt)
        bar.update()
        out = Path(out_dir) if out_dir is not None else cache_root() / f"{model_dir.name}-{key}"
        marker = out / IR_MARKER
        if marker.exists() and json.loads(marker.read_text()).get("key") == key:
            bar.set_postfix_str("cached")
            bar.update(2)
            return out
        bar.set_postfix_str("exporting (optimum-intel)")
        _export(model_dir, out, fmt, key, show_output=progress)
        bar.update()
        bar.set_postfix_str("done")
        bar.update()
        return out
    finally:
        bar.close()


def _export(model_dir: Path, out: Path, fmt: str, key: str, show_output: bool) -> None:
    python = export_python()
    if not python.exists():
        raise RuntimeError(f"the OpenVINO exporter environment is missing ({python}); "
                           "run `make install` (it creates .venv-openvino)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    cmd = [str(python), "-m", "optimum.commands.optimum_cli", "export", "openvino",
           "--model", str(model_dir), "--task", "text-generation-with-past",
           "--weight-format", fmt, str(tmp)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    try:
        result = subprocess.run(cmd, env=env, text=True,
                                stdout=None if show_output else subprocess.PIPE,
                                stderr=subprocess.STDOUT if not show_output else None)
        if result.returncode != 0 or not (tmp / "openvino_model.xml").exists():
            tail = (result.stdout or "")[-4000:]
            raise RuntimeError(f"optimum-intel export of {model_dir} failed "
                               f"(exit {result.returncode}):\n{tail}")
        (tmp / IR_MARKER).write_text(json.dumps({
            "key": key, "source": str(model_dir), "weight_format": fmt,
            "export_s": round(time.perf_counter() - started, 3)}) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# -- the engine ------------------------------------------------------------------------------------

@dataclass
class _Request(PipelinedRequest):
    pipe_id: int | None = None  # id in the pipeline while it runs there
    handle: object = None


class OpenVINOEngine(RequestBook):
    name = "openvino"

    def __init__(self, model_dir: str | Path, device: str = "cpu",
                 kv_capacity_bytes: int | None = None, dtype: str | None = None,
                 ir_dir: str | Path | None = None, max_num_seqs: int = 256,
                 compile_cache: bool = True) -> None:
        if not str(device).startswith("cpu"):
            raise ValueError(f"the openvino engine runs on cpu, not {device!r}")
        if dtype is not None and dtype not in PRECISIONS:
            raise ValueError(f"dtype must be one of {sorted(PRECISIONS)} or None, not {dtype!r}")
        self.model_dir = Path(model_dir)
        self.device = "cpu"
        self.dtype_name = dtype
        self.ir_dir = Path(ir_dir) if ir_dir is not None else None
        self.max_num_seqs = max_num_seqs
        self.compile_cache = compile_cache
        self._initial_kv_bytes = kv_capacity_bytes
        self.load_info: dict[str, object] = {}  # conversion, compile cache state, build times
        self.pipe = None
        self.requests: dict[str, _Request] = {}
        self._by_pipe: dict[int, str] = {}
        self._next_pipe_id = 0
        self._zombie_blocks = 0  # blocks of cancelled requests the pipeline frees on its next step
        self.num_blocks = 0
        self.block_bytes = 0
        self.last_rebuild: dict[str, float] = {}

    # -- lifecycle -----------------------------------------------------------------------------

    def load(self) -> None:
        if self.pipe is not None:
            return
        started = time.perf_counter()
        self.ir_dir = ensure_ir(self.ir_dir or self.model_dir)
        self.convert_s = time.perf_counter() - started
        cache = self._compile_cache_dir()
        self.load_info = {"convert_s": self.convert_s, "compile_cache": str(cache or ""),
                          "compile_cache_warm": bool(cache and any(cache.glob("*.blob")))}
        config = json.loads((self.model_dir / "config.json").read_text())
        self.config = config
        self.max_context = int(config["max_position_embeddings"])
        self.vocab_size = int(config["vocab_size"])
        self._weight_bytes = sum(p.stat().st_size for p in self.ir_dir.glob("openvino_model.bin"))
        # The pool's bytes per block are known only once a pipeline has allocated one: size the
        # first build with an estimate (2 bytes per K/V element), rebuild if the estimate was off.
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        estimate = (2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim
                    * (4 if self.dtype_name == "float32" else 2) * BLOCK_SIZE)
        for block_bytes in (estimate, None):
            block_bytes = block_bytes or self.block_bytes
            if self._initial_kv_bytes is None:
                tokens = min(DEFAULT_KV_TOKENS, 4 * self.max_context)
                blocks = -(-tokens // BLOCK_SIZE)
            else:
                blocks = self._initial_kv_bytes // block_bytes
            if self.pipe is None or blocks != self.num_blocks:
                self._build(blocks)
        self.load_info["load_s"] = time.perf_counter() - started

    def unload(self) -> None:
        self._drop_pipeline()
        self.requests.clear()
        self._by_pipe.clear()

    def _compile_cache_dir(self) -> Path | None:
        """OpenVINO's model cache (CACHE_DIR) beside the IR: the compiled model is an artifact
        tier of its own. The first build compiles and writes it; every later build of the same IR
        and properties (a resize, another instance, a restart) imports it instead of compiling.
        OpenVINO keys the blobs by model, device and properties, so one directory serves every
        dtype. None when off or when the IR directory is not writable."""
        if not self.compile_cache:
            return None
        cache = self.ir_dir / "compiled"
        try:
            cache.mkdir(exist_ok=True)
        except OSError:
            return None
        return cache if os.access(cache, os.W_OK) else None

    def _properties(self) -> dict[str, str]:
        properties = {}
        if (cache := self._compile_cache_dir()) is not None:
            properties["CACHE_DIR"] = str(cache)
        if self.dtype_name is not None:
            compute, kv = PRECISIONS[self.dtype_name]
            properties |= {"INFERENCE_PRECISION_HINT": compute, "KV_CACHE_PRECISION": kv}
        return properties

    def _build(self, num_blocks: int) -> None:
        """A fresh pipeline with `num_blocks` KV blocks, its pool allocated (by one probe step of
        a one-token request, so the allocation is paid here and not by the next iteration)."""
        import numpy as np
        import openvino as ov
        import openvino_genai as ov_genai

        self._drop_pipeline()
        config = ov_genai.SchedulerConfig()
        config.num_kv_blocks = max(1, num_blocks)
        config.dynamic_split_fuse = False  # a prompt step schedules no decode
        config.max_num_batched_tokens = self.max_context  # never split a prompt
        config.max_num_seqs = self.max_num_seqs
        config.enable_prefix_caching = False
        config.use_cache_eviction = False
        started = time.perf_counter()
        self.pipe = ov_genai.ContinuousBatchingPipeline(str(self.ir_dir), config, "CPU",
                                                        self._properties())
        self.load_info.setdefault("build_s", []).append(time.perf_counter() - started)
        probe = self.pipe.add_request(self._new_pipe_id(), ov.Tensor(np.array([[0]], np.int64)),
                                      self._generation_config(SamplingParams(1), 0, 1))
        self.pipe.step()
        probe.cancel()
        if self.pipe.has_non_finished_requests():
            self.pipe.step()  # nothing scheduled: frees the probe
        self.num_blocks = config.num_kv_blocks
        size = self.pipe.get_metrics().kv_cache_size_in_bytes
        if not size:
            raise RuntimeError("the OpenVINO pipeline reported no KV cache after a step")
        self.block_bytes = size // self.num_blocks
        self._zombie_blocks = 0

    def _drop_pipeline(self) -> None:
        if self.pipe is None:
            return
        for request in self.requests.values():
            self._cancel(request)
        if self.pipe.has_non_finished_requests():
            self.pipe.step()  # only cancelled requests are left: this frees them
        self.pipe = None
        self._zombie_blocks = 0

    # -- protocol: memory ----------------------------------------------------------------------

    def memory(self) -> MemoryReport:
        self._loaded()
        return MemoryReport(
            weight_bytes=self._weight_bytes,
            kv_capacity_bytes=self.num_blocks * self.block_bytes,
            kv_used_bytes=self._used_blocks() * self.block_bytes,
            kv_bytes_per_token=self.block_bytes // BLOCK_SIZE,
        )

    def _used_blocks(self) -> int:
        """Blocks of live requests plus cancelled ones the pipeline has not freed yet."""
        return self._zombie_blocks + sum(_blocks(r.pipe_tokens - 1)
                                         for r in self.requests.values() if r.pipe_id is not None)

    def resize_kv(self, capacity_bytes: int) -> None:
        """Rebuild the pipeline with capacity_bytes // block_bytes blocks and recompute the KV of
        every running request (see the module docstring). ValueError, with nothing changed, when
        the running requests would not fit."""
        self._loaded()
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        blocks = capacity_bytes // self.block_bytes
        running = [(rid, r) for rid, r in self.requests.items() if r.pipe_id is not None]
        need = sum(_blocks(r.pipe_tokens) for _, r in running)
        if blocks < need:
            raise ValueError(f"{blocks} blocks cannot hold the {need} blocks that recomputing the "
                             f"{len(running)} running requests needs")
        if blocks != self.num_blocks:
            self._rebuild(blocks)

    def _rebuild(self, blocks: int) -> None:
        running = [(rid, r) for rid, r in self.requests.items() if r.pipe_id is not None]
        started = time.perf_counter()
        saved = {rid: (r.tokens + list(r.ahead), list(r.ahead)) for rid, r in running}
        self._build(blocks)  # cancels everything in the old pipeline
        built = time.perf_counter()
        for rid, request in running:
            tokens, ahead = saved[rid]
            request.ahead = deque(ahead)
            self._submit(rid, request, tokens)
        pending = {rid for rid, _ in running}
        for _ in range(len(running) + 1):  # one batched prompt step, more if they do not fit
            if not pending:
                break
            self.pipe.step()
            for rid, token in self._read_outputs().items():
                self.requests[rid].ahead.append(token)
                pending.discard(rid)
        if pending:
            raise RuntimeError(f"recompute after the rebuild produced no token for {pending}")
        self.last_rebuild = {"build_s": built - started,
                             "recompute_s": time.perf_counter() - built,
                             "recomputed_tokens": float(sum(r.pipe_tokens for _, r in running))}

    # -- protocol: requests --------------------------------------------------------------------

    def add_request(self, request_id: str, token_ids: list[int], params: SamplingParams) -> None:
        self._loaded()
        self.check_new(request_id, token_ids, params, self.max_context, self.vocab_size)
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        self.requests[request_id] = _Request(list(token_ids), params, seed)

    def release(self, request_id: str) -> None:
        """Drop a finished or cancelled request; releasing an unknown id is a no-op."""
        request = self.requests.pop(request_id, None)
        if request is not None and self.pipe is not None:
            self._cancel(request)
            if not any(r.pipe_id is not None for r in self.requests.values()) \
                    and self.pipe.has_non_finished_requests():
                self.pipe.step()  # nothing else runs: an empty step frees the blocks now
                self._zombie_blocks = 0

    # -- protocol: iterations ------------------------------------------------------------------

    def prefill(self, request_id: str) -> StepResult:
        self._loaded()
        request = self._request(request_id)
        if request.prefilled:
            raise ValueError(f"request {request_id!r} is already prefilled")
        self._make_room(_blocks(len(request.tokens)), f"prefill of {len(request.tokens)} tokens")
        self._submit(request_id, request, request.tokens)
        self._step()
        outputs = self._read_outputs()
        if request_id not in outputs:
            self._cancel(request)
            raise RuntimeError(f"the pipeline's prompt step produced no token for {request_id!r}")
        request.prefilled = True
        token = outputs.pop(request_id)
        for rid, other in outputs.items():  # cannot happen in a prompt step; kept, not lost
            self.requests[rid].ahead.append(other)
        request.hand_out(token)
        return StepResult({request_id: token})

    def decode(self, request_ids: list[str]) -> StepResult:
        self._loaded()
        if not request_ids:
            return StepResult({})
        if len(set(request_ids)) != len(request_ids):
            raise ValueError("duplicate request ids in one decode step")
        requests = [self._request(rid) for rid in request_ids]
        if unready := [rid for rid, r in zip(request_ids, requests) if not r.prefilled]:
            raise ValueError(f"requests not prefilled: {unready}")
        if any(not r.ahead for r in requests):
            running = [r for r in self.requests.values() if r.pipe_id is not None]
            if done := [rid for rid, r in zip(request_ids, requests)
                        if not r.ahead and r.pipe_tokens >= self.max_context]:
                raise ValueError(f"requests at the model's context of {self.max_context}: {done}")
            grow = sum(_blocks(r.pipe_tokens) - _blocks(r.pipe_tokens - 1) for r in running)
            if self._make_room(grow, "decode step", decode=True):
                return self.decode(request_ids)  # rebuilt: some tokens are now ahead
            self._step()
            produced = self._read_outputs()
            for rid, token in produced.items():
                self.requests[rid].ahead.append(token)
            if missing := [rid for rid, r in zip(request_ids, requests) if not r.ahead]:
                raise RuntimeError(f"the pipeline's step produced no token for {missing}")
        tokens = {}
        for rid, request in zip(request_ids, requests):
            tokens[rid] = request.ahead.popleft()
            request.hand_out(tokens[rid])
        return StepResult(tokens)

    # -- pipeline plumbing ---------------------------------------------------------------------

    def _make_room(self, need: int, what: str, decode: bool = False) -> bool:
        """KVCacheFull unless `need` more blocks fit among live requests. When they fit only once
        cancelled requests are freed (which the pipeline does at the end of its next step, too
        late for that step's scheduling), rebuild the pipeline at the same size, which drops
        them and recomputes the live ones; returns True then. (A recompute computes each running
        request's last token too, which is what a decode step needs its new blocks for.)"""
        live = self._used_blocks() - self._zombie_blocks
        if live + need > self.num_blocks:
            raise KVCacheFull(f"{what} needs {need} blocks; {self.num_blocks - live} free")
        if live + self._zombie_blocks + need <= self.num_blocks:
            return False
        running = [r for r in self.requests.values() if r.pipe_id is not None]
        if sum(_blocks(r.pipe_tokens) for r in running) + (0 if decode else need) \
                > self.num_blocks:
            raise KVCacheFull(f"{what} needs {need} blocks; {self.num_blocks - live} free once "
                              "released requests are dropped, but not after a recompute")
        self._rebuild(self.num_blocks)
        return True

    def _step(self) -> None:
        self.pipe.step()
        self._zombie_blocks = 0  # cancelled requests are freed at the end of every step

    def _submit(self, request_id: str, request: _Request, tokens: list[int]) -> None:
        import numpy as np
        import openvino as ov

        pipe_id = self._new_pipe_id()
        config = self._generation_config(request.params, request.seed,
                                         self.max_context - len(tokens), request.generated)
        request.handle = self.pipe.add_request(pipe_id, ov.Tensor(np.array([tokens], np.int64)),
                                               config)
        request.pipe_id = pipe_id
        self._by_pipe[pipe_id] = request_id

    def _read_outputs(self) -> dict[str, int]:
        """One token per request that the last step advanced."""
        out = {}
        for request_id, request in self.requests.items():
            handle = request.handle
            if handle is None or not handle.can_read():
                continue
            ids = [t for o in handle.read().values() for t in o.generated_ids]
            if len(ids) > 1:
                raise RuntimeError(f"the pipeline produced {len(ids)} tokens for {request_id!r} "
                                   "in one step")
            if ids:
                out[request_id] = int(ids[0])
        return out

    def _cancel(self, request: _Request) -> None:
        if request.pipe_id is None:
            return
        self._zombie_blocks += _blocks(request.pipe_tokens - 1)
        request.handle.cancel()
        self._by_pipe.pop(request.pipe_id, None)
        request.pipe_id = request.handle = None
        request.ahead.clear()

    def _generation_config(self, params: SamplingParams, seed: int, max_new: int,
                           generated: int = 0):
        """The pipeline's GenerationConfig for a (re)submission after `generated` tokens."""
        import openvino_genai as ov_genai

        config = ov_genai.GenerationConfig()
        config.max_new_tokens = max(1, max_new)
        config.ignore_eos = True  # the node scheduler decides when a request ends
        config.repetition_penalty = params.repetition_penalty  # greedy or sampled alike
        # The pipeline holds back its stop tokens until min_new_tokens: ours are the EOS ids.
        config.stop_token_ids = set(params.eos_token_ids)
        config.min_new_tokens = min(max(0, params.min_tokens - generated), config.max_new_tokens)
        if params.temperature > 0:
            config.do_sample = True
            config.temperature = params.temperature
            config.top_p = params.top_p
            if params.top_k > 0:  # else the pipeline's default: no limit
                config.top_k = params.top_k
            config.rng_seed = seed
        else:
            config.do_sample = False
        return config

    def _new_pipe_id(self) -> int:
        self._next_pipe_id += 1
        return self._next_pipe_id

    def _loaded(self) -> None:
        if self.pipe is None:
            raise RuntimeError("engine is not loaded; call load() first")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.config.get("eos_token_id")
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, list) else (eos,)


def _blocks(tokens: int) -> int:
    return blocks(tokens, BLOCK_SIZE)


# -- `slinfer convert-openvino` --------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="slinfer convert-openvino",
        description="Convert a Hugging Face model directory to OpenVINO IR with optimum-intel "
                    "(offline), into a content-keyed cache the openvino engine reads.")
    p.add_argument("--model", required=True, type=Path, help="Hugging Face model directory")
    p.add_argument("--out", type=Path,
                   help="IR directory (default: the cache, $SLINFER_OPENVINO_CACHE or "
                        "~/.cache/slinfer/openvino)")
    args = p.parse_args(argv)
    try:
        out = ensure_ir(args.model, args.out, progress=True)
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
