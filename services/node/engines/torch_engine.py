"""The reference engine: Hugging Face Llama modules, our own attention over a paged KV cache.

The model's own modules do the dense work (embeddings, q/k/v/o projections, MLP, RMS norms,
rotary embedding); attention is written here so K/V live in `PagedKVCache`, whose pool can be
resized at run time and whose blocks a request gives back on release or evict.

One call = one iteration, as the node scheduler decides: `prefill(id)` runs one request's whole
token list alone; `decode(ids)` runs one batched step for requests of different lengths (their
cached K/V are gathered per layer, in groups of similar length, into a reused buffer, padded
within a group and masked), one new token each.

Sampling is greedy at temperature 0; otherwise temperature + top-k + top-p, with the uniform draw
of each step taken from a torch.Generator seeded from (params.seed, token position). A seeded
request is therefore reproducible, and also continues identically after an evict and re-add. The
logit processors (logit_bias, min_tokens' EOS ban, the repetition, presence and frequency
penalties; sampling.py) change the logits first, for greedy rows too; min_p filters sampled rows
after temperature. A request with an output grammar (response_format, a forced tool call) has its
row masked last to the tokens the grammar allows next (grammar.py), so greedy and sampled rows
alike produce only output that matches it.

LoRA adapters (lora.py) are loaded beside the backbone with `load_adapter(name, dir)` and applied
unmerged, per request (`SamplingParams.adapter`): a decode step orders its rows by adapter and adds
each adapter's `scale · B (A x)` to its own rows of every projection it targets, so one copy of the
backbone serves a batch that mixes adapters and plain base requests. Loading one reads only its A/B
matrices (`MemoryReport.adapter_bytes`); the backbone's tensors are never changed.
"""

from __future__ import annotations

import gc
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.engine_features import ENGINE_FEATURES

from ..loader import CheckpointLoader, LoaderSettings
from .base import (KVCacheFull, MemoryReport, RequestBook, SamplingParams, StepResult,
                   TokenLogprobs)
from .grammar import Grammars, TokenGrammar, mask_rows
from .kv_cache import PagedKVCache
from .lora import LoraAdapter, LoraBatch, group_by_adapter, read_adapter
from .pooling import pool
from .sampling import add_logit_bias, keep_min_p, penalize_output, prompt_logprobs
from .split import Split
from .stage_client import StageClient
from .torch_kernel import (DECODE_WORKSPACE_BYTES, DEFAULT_BLOCK_SIZE, StepSpec, Workspace,
                           abort_step, decoder_layer, finish_step, open_attention, reserve_step)
from .weights import (BUILD_LOCK, DTYPES, check_supported, config_dtype, layer_of, partial_model,
                      read_tensors, rebuild_meta_buffers, weight_bytes)

DEFAULT_KV_TOKENS = 16384  # default pool: min(this, 4 x context length) tokens

__all__ = ["TorchEngine", "KVCacheFull"]


@dataclass
class _Request:
    tokens: list[int]  # prompt (+ resumed tokens) + generated; the last one has no K/V yet
    params: SamplingParams
    seed: int  # params.seed, or a random one drawn at add time
    computed: int = 0  # tokens whose K/V are in the cache; 0 until prefilled
    generated: int = 0  # tokens sampled since add_request
    adapter: LoraAdapter | None = None  # params.adapter's weights; None: the plain base
    prompt_len: int = 0  # tokens before the output (the penalties count only the output)
    grammar: TokenGrammar | None = None  # params.grammar's matcher, where the request has one
    # Chunked prefill: tokens whose K/V earlier chunks wrote (0: none yet), and what those
    # chunks computed for the result (prompt logprobs; an embedding's running sum, first state).
    chunked: int = 0
    chunk_state: dict | None = None

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len:]


class TorchEngine(RequestBook):
    name = "torch"
    features = ENGINE_FEATURES["torch"]  # logprobs (StepResult.logprobs), penalties, bias, min_p

    def __init__(self, model_dir: str | Path, device: str = "cpu",
                 kv_capacity_bytes: int | None = None, dtype: str | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE,
                 loader: CheckpointLoader | None = None,
                 remote_layers: list[str] | None = None,
                 weights: dict[str, torch.Tensor] | None = None) -> None:
        """`remote_layers`: addresses (host:port) of layer stages (services/node/engines/stage_server.py)
        that run some of the decoder layers; this process then loads only the others (plus
        embeddings, final norm and head), from `weights` when given (tensors by checkpoint
        name, e.g. views of a partly received host checkpoint), else from the checkpoint's
        files (those tensors' bytes only)."""
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)} or None, not {dtype!r}")
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.dtype_name = dtype
        self.block_size = block_size
        self._initial_kv_bytes = kv_capacity_bytes
        self._loader = loader  # the node's; None: a private one without caches
        self.model = None
        self.cache: PagedKVCache | None = None
        self.requests: dict[str, _Request] = {}
        self.adapters: dict[str, LoraAdapter] = {}  # LoRA adapters loaded, by name
        self.load_info: dict[str, object] = {}  # how the weights came: source, tier, s, bytes
        self._remote_layers = list(remote_layers or [])
        self._weights = weights
        self.split: Split | None = None  # once some layers run elsewhere (or have replicas)
        self._grammars: Grammars | None = None  # made with the first constrained request

    # -- lifecycle -----------------------------------------------------------------------------

    def load(self) -> None:
        """Load weights and allocate the KV pool. Weights come from the loader when the model
        has a converted checkpoint in one of its tiers, else from the Hugging Face files."""
        from transformers import AutoConfig

        if self.model is not None:
            return
        config = AutoConfig.from_pretrained(self.model_dir, local_files_only=True)
        check_supported(config)
        started = time.perf_counter()
        if self._remote_layers:
            self._load_split(config, started)
            return
        loader = self._loader or CheckpointLoader(LoaderSettings(dram_bytes_per_s=1e10))
        try:
            if loader.has_checkpoint(self.model_dir):
                model = self._model_from_loader(loader, config)
            else:
                with BUILD_LOCK:  # (weights.BUILD_LOCK: builds take turns)
                    model = self._model_from_hf()
        finally:
            if self._loader is None:
                loader.close()
        self.model = model.to(self.device).eval()
        self.load_info["seconds"] = time.perf_counter() - started
        self.config = config
        self.dtype = self.model.dtype
        # parameters() yields tied tensors once, so a tied lm_head is not counted twice.
        self._weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.cache = self._new_cache(config)
        self._workspace = Workspace(self.cache, DECODE_WORKSPACE_BYTES)

    def _load_split(self, config, started: float) -> None:
        """Only the layers no stage runs, then the stages attached (their pools sized to ours)."""
        clients = [StageClient(address) for address in self._remote_layers]
        try:
            remote = [i for c in clients for i in range(c.start, c.end)]
            if len(set(remote)) != len(remote):
                raise ValueError("remote layer stages overlap")
            if len(remote) >= config.num_hidden_layers:
                raise ValueError("an instance keeps at least one decoder layer in its own process")
            held = set(remote)
            local = lambda n: layer_of(n) not in held  # noqa: E731 - None (not a layer) is local
            if self._weights is not None:
                tensors = {k: t for k, t in self._weights.items() if local(k)}
                self.load_info = {"source": "weights"}
            else:
                tensors = read_tensors(self.model_dir, local)
                self.load_info = {"source": "checkpoint-files"}
            dtype = DTYPES[self.dtype_name] if self.dtype_name else None
            self.model = partial_model(config, tensors, dtype, self.device, local)
            self.config = config
            self.dtype = next(self.model.parameters()).dtype
            self.cache = self._new_cache(config, config.num_hidden_layers - len(held))
            self._workspace = Workspace(self.cache, DECODE_WORKSPACE_BYTES)
            split = Split(self, config.num_hidden_layers)
            for client in clients:
                split.attach(client)
            split.compact()
        except BaseException:
            for client in clients:
                client.close()
            self.model = self.cache = None
            raise
        self.split = split
        self._weight_bytes = weight_bytes(self.model)
        self.load_info["seconds"] = time.perf_counter() - started
        self.load_info["bytes"] = self._weight_bytes

    # -- layers across processes (split.py, stage_client.py) -----------------------------------

    def attention_for(self, spec: StepSpec):
        """The attention of `spec`'s rows over this engine's cache and decode workspace (for the
        split instance's local share of a replicated run: `split.SplitHost`)."""
        return open_attention(self.cache, spec, self._workspace)

    def _split(self):
        self._loaded()
        if self.adapters:
            raise ValueError("an instance with LoRA adapters loaded runs all its layers here")
        if self.split is None:
            self.split = Split(self, self.config.num_hidden_layers)
        return self.split

    def _moved(self) -> None:
        self._weight_bytes = weight_bytes(self.model)  # the dropped layers' memory is freed
        # by reference counting: no gc.collect() here, it took ~0.2 s of the pause

    def shed_layers(self, address: str) -> None:
        """Migrate the layers the stage at `address` has loaded (local ones) to it, with the
        K/V of every request: this process stops running them and frees their weights and
        K/V pools (CoCoServe's module migration). Call between iterations."""
        split = self._split()
        client = StageClient(address)
        try:
            split.shed(client)
        except BaseException:
            client.close()
            raise
        self._moved()

    def take_layers(self, start: int, end: int,
                    tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Run remote layers [start, end) here again (λScale's mode switch once this node has
        the whole model): their weights from `tensors` (else the checkpoint's files), their
        K/V received from the stages, which are let go. Call between iterations."""
        split = self._split()
        if tensors is None:
            tensors = read_tensors(self.model_dir, lambda n: (i := layer_of(n)) is not None
                                   and start <= i < end)
        split.take(start, end, tensors)
        self._moved()

    def replicate_layers(self, address: str) -> None:
        """The stage at `address` holds a copy of some local layers: requests computed from now
        on are spread between this process and it for those layers (CoCoServe replication)."""
        split = self._split()
        client = StageClient(address)
        try:
            split.replicate(client)
        except BaseException:
            client.close()
            raise

    def drop_replica(self, address: str) -> None:
        """Stop using a replica; its requests' K/V of those layers comes back here first."""
        self._split().drop_replica(address)

    def layout(self):
        """Where the layers run (a split.Layout); all local for an unsplit instance."""
        self._loaded()
        return (self.split or Split(self, self.config.num_hidden_layers)).layout()

    def _model_from_hf(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        dtype = DTYPES[self.dtype_name] if self.dtype_name else "auto"
        self.load_info = {"source": "hf"}
        return AutoModelForCausalLM.from_pretrained(self.model_dir, local_files_only=True,
                                                    dtype=dtype)

    def _model_from_loader(self, loader: CheckpointLoader, config) -> torch.nn.Module:
        """The model built on the meta device (no memory, no init), then given the loader's
        tensors as its parameters (assign=True): on CPU they view the loader's host pool, so
        the weights are read once into memory and never copied."""
        from transformers import AutoModelForCausalLM, GenerationConfig

        result = loader.load(self.model_dir, device=self.device)
        self.load_info = {"source": "loader", "tier": result.tier,
                          "loader_seconds": result.seconds, "bytes": result.bytes,
                          "direct": result.direct}
        state = result.state_dict
        dtype = DTYPES[self.dtype_name] if self.dtype_name else config_dtype(config, state)
        if any(t.is_floating_point() and t.dtype != dtype for t in state.values()):
            state = {k: t.to(dtype) if t.is_floating_point() else t for k, t in state.items()}
        with BUILD_LOCK:  # the checkpoint was read above, outside it
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            model.load_state_dict(state, strict=False, assign=True)
            model.tie_weights()
            rebuild_meta_buffers(model, config, self.device)
        if left := [n for n, p in model.named_parameters() if p.is_meta]:
            raise ValueError(f"the checkpoint of {self.model_dir} lacks {left[:5]}")
        if (self.model_dir / "generation_config.json").is_file():
            model.generation_config = GenerationConfig.from_pretrained(self.model_dir)
        return model

    def unload(self) -> None:
        """Drop weights, KV pool and all requests; device memory is handed back."""
        if self.split is not None:
            self.split.close()
            self.split = None
        self.model = None
        self.cache = None
        self._workspace = None
        self.requests.clear()
        self.adapters.clear()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _new_cache(self, config, layers: int | None = None) -> PagedKVCache:
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        layers = config.num_hidden_layers if layers is None else layers
        cache = PagedKVCache(layers, 0, self.block_size,
                             config.num_key_value_heads, head_dim, self.dtype, self.device)
        capacity = self._initial_kv_bytes
        if capacity is None:
            tokens = min(DEFAULT_KV_TOKENS, 4 * config.max_position_embeddings)
            capacity = tokens * cache.bytes_per_token
        cache.resize(capacity // cache.block_bytes)
        return cache

    # -- protocol: memory ----------------------------------------------------------------------

    def memory(self) -> MemoryReport:
        _, cache = self._loaded()
        return MemoryReport(
            weight_bytes=self._weight_bytes,
            kv_capacity_bytes=cache.num_blocks * cache.block_bytes,
            kv_used_bytes=cache.used_blocks * cache.block_bytes,
            kv_bytes_per_token=cache.bytes_per_token,
            adapter_bytes=sum(a.nbytes for a in list(self.adapters.values())),  # a snapshot
        )

    def resize_kv(self, capacity_bytes: int) -> None:
        """Resize the pool to capacity_bytes rounded down to whole blocks; ValueError if that is
        fewer blocks than the live requests hold (nothing changes then)."""
        _, cache = self._loaded()
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        cache.resize(capacity_bytes // cache.block_bytes)
        if self.split is not None:  # the stages' pools mirror ours, block for block
            self.split.resize(cache.num_blocks)

    # -- protocol: requests --------------------------------------------------------------------

    def add_request(self, request_id: str, token_ids: list[int], params: SamplingParams) -> None:
        self._loaded()
        self.check_new(request_id, token_ids, params, self.config.max_position_embeddings,
                       self.config.vocab_size)
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        if params.adapter is not None and self.split is not None:
            raise ValueError("LoRA adapters are not served by an instance split across stages")
        adapter = None if params.adapter is None else self.adapters[params.adapter]
        prompt_len = len(token_ids) - params.prior_output
        grammar = None
        if params.grammar is not None:
            if self._grammars is None:
                self._grammars = Grammars(self.model_dir, self.config.vocab_size)
            grammar = self._grammars.start(params.grammar, params.eos_token_ids,
                                           list(token_ids[prompt_len:]))
        self.requests[request_id] = _Request(list(token_ids), params, seed, adapter=adapter,
                                             prompt_len=prompt_len, grammar=grammar)

    # -- LoRA adapters -------------------------------------------------------------------------

    def load_adapter(self, name: str, path: str | Path) -> int:
        """Load a PEFT LoRA adapter for this backbone under `name`; returns its bytes. Loading
        a name again from the same directory is a no-op; from another directory it replaces the
        adapter, which only an adapter without requests may be (ValueError otherwise, as for a
        directory that is not an adapter of this backbone)."""
        self._loaded()
        if self.split is not None:
            raise ValueError("LoRA adapters are not served by an instance split across stages")
        path = Path(path)
        old = self.adapters.get(name)
        if old is not None:
            if old.path == path:
                return old.nbytes
            self._check_unused(name)
        adapter = read_adapter(name, path, self.config, self.device, self.dtype)
        self.adapters[name] = adapter
        return adapter.nbytes

    def unload_adapter(self, name: str) -> None:
        """Drop an adapter's weights; a no-op for a name not loaded. An adapter that requests
        still run through is not dropped (ValueError): release or evict them first."""
        if name in self.adapters:
            self._check_unused(name)
            del self.adapters[name]

    def _check_unused(self, name: str) -> None:
        if users := [rid for rid, r in self.requests.items() if r.params.adapter == name]:
            raise ValueError(f"LoRA adapter {name!r} has {len(users)} request(s) in flight")

    def release(self, request_id: str) -> None:
        """Drop a finished or cancelled request; releasing an unknown id is a no-op."""
        self.requests.pop(request_id, None)
        if self.cache is not None:
            self.cache.free(request_id)
        if self.split is not None:
            self.split.release(request_id)

    # -- protocol: iterations ------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, request_id: str) -> StepResult:
        """All of the request's tokens in one forward pass; returns its next token (an
        embedding request's: its pooled hidden states, and no token)."""
        _, cache = self._loaded()
        request = self._request(request_id)
        if request.computed:
            raise ValueError(f"request {request_id!r} is already prefilled")
        if request.chunked:
            return self.prefill_chunk(request_id, len(request.tokens) - request.chunked)
        n = len(request.tokens)
        spec = StepSpec("prefill", (request_id,), (0,), (n,))
        reserve_step(cache, spec)  # KVCacheFull here leaves everything untouched
        try:
            ids = torch.tensor([request.tokens], device=self.device)
            positions = torch.arange(n, device=self.device)[None]
            lora = LoraBatch.of_rows([request.adapter])
            prompt: dict[str, list[TokenLogprobs]] = {}
            embedding = request.params.embedding
            if embedding is not None:  # no token: the pooled hidden states are the answer
                hidden = self._hidden(ids, positions, spec, lora,
                                      last_only=embedding.pooling == "last")
                vector = pool(hidden[0], embedding)
            elif request.params.prompt_logprobs is None:
                logits = self._forward(ids, positions, spec, lora)
            else:  # every position's hidden state: each predicts the prompt token after it
                hidden = self._hidden(ids, positions, spec, lora, last_only=False)
                logits = self.model.lm_head(hidden[:, -1:])
                prompt[request_id] = prompt_logprobs(
                    self.model.lm_head, hidden[0], request.tokens[1:request.prompt_len],
                    request.params.prompt_logprobs or 0)
            if embedding is None:
                (token,), logprobs = self._pick(logits[:, -1], [request_id], [request])
        except BaseException:
            abort_step(cache, spec)
            raise
        finish_step(cache, spec)
        if embedding is not None:
            request.computed = n  # its K/V stay until the node releases it, at once
            return StepResult(embeddings={request_id: vector})
        self._append(request, token, computed=n)
        return StepResult({request_id: token}, logprobs, prompt)

    @torch.inference_mode()
    def prefill_chunk(self, request_id: str, tokens: int) -> StepResult:
        """The next `tokens` of the request's prefill (chunked prefill), against the K/V its
        earlier chunks wrote: the first chunk is a prefill of its tokens, a later one an extend
        of the cached ones. The chunk that reaches the end returns what `prefill` would: the
        next token (with the prompt logprobs each chunk computed for its positions), or an
        embedding request's vector (pooled from what each chunk kept: a running sum, the first
        state); an empty StepResult before it."""
        _, cache = self._loaded()
        request = self._request(request_id)
        if request.computed:
            raise ValueError(f"request {request_id!r} is already prefilled")
        start, n = request.chunked, len(request.tokens)
        if not 0 < tokens <= n - start:
            raise ValueError(f"a chunk of {tokens} tokens after {start} does not fit the "
                             f"request's {n}")
        if start == 0 and tokens == n:
            return self.prefill(request_id)
        spec = StepSpec("prefill" if start == 0 else "extend", (request_id,), (start,), (tokens,))
        reserve_step(cache, spec)  # KVCacheFull here leaves everything untouched
        try:
            hidden = self._chunk_hidden(request, spec)
            result, state = self._chunk_result(request_id, request, hidden, start + tokens == n)
        except BaseException:
            abort_step(cache, spec)
            raise
        finish_step(cache, spec)
        request.chunked, request.chunk_state = start + tokens, state
        if request.chunked < n:
            return StepResult()
        request.chunked, request.chunk_state = 0, None
        if result.embeddings:
            request.computed = n  # its K/V stay until the node releases it, at once
        else:
            self._append(request, result.tokens[request_id], computed=n)
        return result

    def _chunk_hidden(self, request: _Request, spec: StepSpec) -> torch.Tensor:
        """The chunk's pass: final hidden states [1, positions, hidden] of all its positions
        where the request needs them (prompt logprobs, mean or cls pooling), else the last."""
        start, count = spec.starts[0], spec.counts[0]
        ids = torch.tensor([request.tokens[start:start + count]], device=self.device)
        lora = LoraBatch.of_rows([request.adapter])
        embedding = request.params.embedding
        every = request.params.prompt_logprobs is not None or (
            embedding is not None and embedding.pooling != "last")
        return self._hidden(ids, spec.positions(self.device), spec, lora, last_only=not every)

    def _chunk_result(self, rid: str, request: _Request, hidden: torch.Tensor, final: bool
                      ) -> tuple[StepResult, dict]:
        """The last chunk's result (empty before it), and the request's `chunk_state` with what
        this chunk adds (a new dict: a failed step leaves the old one as it was). Positions
        start..end-1 predict prompt tokens start+1..end; a pooled embedding keeps the sum of its
        states and the first one."""
        start, state = request.chunked, dict(request.chunk_state or {})
        embedding = request.params.embedding
        if embedding is not None:
            states = hidden[0].float()
            state["sum"] = states.sum(dim=0) + state.get("sum", 0)
            state.setdefault("first", states[0])
            if not final:
                return StepResult(), state
            n = len(request.tokens)
            summary = {"mean": state["sum"] / n, "cls": state["first"],
                       "last": states[-1]}[embedding.pooling]
            return StepResult(embeddings={rid: pool(summary[None], embedding)}), state
        k = request.params.prompt_logprobs
        if k is not None:
            count = hidden.shape[1]
            targets = request.tokens[start + 1:min(start + count + 1, request.prompt_len)]
            state["prompt"] = [*state.get("prompt", []), *(
                prompt_logprobs(self.model.lm_head, hidden[0, :len(targets)], targets, k or 0)
                if targets else [])]
        if not final:
            return StepResult(), state
        logits = self.model.lm_head(hidden[:, -1:])
        (token,), logprobs = self._pick(logits[:, -1], [rid], [request])
        prompt = {rid: state["prompt"]} if k is not None else {}
        return StepResult({rid: token}, logprobs, prompt), state

    @torch.inference_mode()
    def decode(self, request_ids: list[str]) -> StepResult:
        """One batched step: each request's last token goes in, one new token comes out."""
        _, cache = self._loaded()
        if not request_ids:
            return StepResult({})
        if len(set(request_ids)) != len(request_ids):
            raise ValueError("duplicate request ids in one decode step")
        requests = [self._request(rid) for rid in request_ids]
        if unready := [rid for rid, r in zip(request_ids, requests) if not r.computed]:
            raise ValueError(f"requests not prefilled: {unready}")
        if any(r.adapter is not None for r in requests):  # rows of one adapter side by side
            order = group_by_adapter([r.params.adapter for r in requests])
            request_ids = [request_ids[i] for i in order]
            requests = [requests[i] for i in order]
        lengths = [r.computed for r in requests]  # also each new token's position
        spec = StepSpec("decode", tuple(request_ids), tuple(lengths), (1,) * len(lengths))
        reserve_step(cache, spec)  # all or nothing
        try:
            ids = torch.tensor([[r.tokens[-1]] for r in requests], device=self.device)
            positions = torch.tensor(lengths, device=self.device)[:, None]
            lora = LoraBatch.of_rows([r.adapter for r in requests])
            logits = self._forward(ids, positions, spec, lora)
            tokens, logprobs = self._pick(logits[:, -1], request_ids, requests)
        except BaseException:
            abort_step(cache, spec)
            raise
        finish_step(cache, spec)
        for request, n, token in zip(requests, lengths, tokens):
            self._append(request, token, computed=n + 1)
        return StepResult(dict(zip(request_ids, tokens)), logprobs)

    @torch.inference_mode()
    def extend(self, request_id: str, token_ids: list[int]) -> StepResult:
        """Live migration's catch-up (ServerlessLLM §5): the tokens after the request's computed
        ones become `token_ids` (they replace the token it sampled last, which the source's own
        tokens supersede); their K/V are computed in one pass against the cached ones, and the
        next token is sampled. They count as generated (min_tokens, like resumed tokens)."""
        _, cache = self._loaded()
        request = self._request(request_id)
        if not request.computed:
            raise ValueError(f"request {request_id!r} is not prefilled")
        if not token_ids:
            raise ValueError("extend needs at least one token")
        n, m = request.computed, len(token_ids)
        old = request.tokens
        spec = StepSpec("extend", (request_id,), (n,), (m,))
        reserve_step(cache, spec)
        try:
            request.tokens = [*old[:n], *token_ids]  # penalties and draws see the true sequence
            if request.grammar is not None:
                request.grammar.follow(request.output)
            ids = torch.tensor([token_ids], device=self.device)
            positions = torch.arange(n, n + m, device=self.device)[None]
            logits = self._forward(ids, positions, spec, LoraBatch.of_rows([request.adapter]))
            (token,), logprobs = self._pick(logits[:, -1], [request_id], [request])
        except BaseException:
            request.tokens = old
            if request.grammar is not None:
                request.grammar.follow(request.output)
            abort_step(cache, spec)
            raise
        finish_step(cache, spec)
        request.generated += m - (len(old) - n)
        self._append(request, token, computed=n + m)
        return StepResult({request_id: token}, logprobs)

    # -- model ---------------------------------------------------------------------------------

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, spec: StepSpec,
                 lora: LoraBatch | None = None) -> torch.Tensor:
        """Logits [batch, seq, vocab] of the last position only ([batch, 1, vocab]); `lora`:
        the adapters of the batch's rows (None: every row runs the plain base). The step's KV
        blocks are reserved by the caller."""
        # Only the last position is sampled: skip the vocab projection for the others.
        return self.model.lm_head(self._hidden(ids, positions, spec, lora))

    def _hidden(self, ids: torch.Tensor, positions: torch.Tensor, spec: StepSpec,
                lora: LoraBatch | None = None, last_only: bool = True) -> torch.Tensor:
        """The final norm's output [batch, seq, hidden], of the last position only where
        `last_only`. An instance split across stages (`split`) runs each run of layers where
        the layout puts it."""
        base = self.model.model
        hidden = base.embed_tokens(ids)
        cos, sin = base.rotary_emb(hidden, positions)
        attention = open_attention(self.cache, spec, self._workspace)
        if self.split is None:
            for index, layer in enumerate(base.layers):
                hidden = decoder_layer(index, index, layer, hidden, cos, sin, attention, lora)
        else:
            hidden = self.split.forward(base.layers, spec, hidden, cos, sin, attention,
                                        last_only=last_only)
        return base.norm(hidden[:, -1:] if last_only else hidden)

    # -- sampling ------------------------------------------------------------------------------

    def _pick(self, logits: torch.Tensor, request_ids: list[str], requests: list[_Request]
              ) -> tuple[list[int], dict[str, TokenLogprobs]]:
        """The next tokens, and the log-probabilities of those whose requests asked for them."""
        tokens = self._sample(logits, requests)
        return tokens, _token_logprobs(logits, request_ids, requests, tokens)

    def _sample(self, logits: torch.Tensor, requests: list[_Request]) -> list[int]:
        """One token per row of logits [batch, vocab]: the requests' logit processors first
        (repetition penalty, EOS held back until min_tokens), then greedy rows by argmax, the
        others by temperature + top-k + top-p with a per-request, per-position seeded draw."""
        logits = _process_logits(logits, requests)
        tokens = logits.argmax(dim=-1)
        rows = [i for i, r in enumerate(requests) if r.params.temperature > 0]
        if rows:
            sampled = self._sample_rows(logits[rows].float(), [requests[i] for i in rows])
            tokens[rows] = sampled
        return tokens.tolist()

    def _sample_rows(self, logits: torch.Tensor, requests: list[_Request]) -> torch.Tensor:
        temps = torch.tensor([r.params.temperature for r in requests], device=logits.device)
        top_p = torch.tensor([r.params.top_p for r in requests], device=logits.device)
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        if any(r.params.min_p for r in requests):
            probs = keep_min_p(probs, torch.tensor([r.params.min_p for r in requests],
                                                   device=logits.device, dtype=probs.dtype))
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        if any(r.params.top_k for r in requests):
            sorted_probs = _keep_top_k(sorted_probs, [r.params.top_k for r in requests])
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs * (mass_before < top_p[:, None])
        cdf = sorted_probs.cumsum(dim=-1)
        draws = torch.tensor([_uniform(r.seed, len(r.tokens)) for r in requests],
                             device=logits.device, dtype=cdf.dtype)
        pick = torch.searchsorted(cdf, (draws * cdf[:, -1])[:, None], right=True)
        pick = pick.clamp(max=cdf.shape[-1] - 1)
        return order.gather(1, pick)[:, 0]

    # -- helpers -------------------------------------------------------------------------------

    def _append(self, request: _Request, token: int, computed: int) -> None:
        if request.grammar is not None:
            request.grammar.advance(token)
        request.tokens.append(token)
        request.computed = computed
        request.generated += 1

    def _loaded(self) -> tuple[torch.nn.Module, PagedKVCache]:
        if self.model is None or self.cache is None:
            raise RuntimeError("engine is not loaded; call load() first")
        return self.model, self.cache

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids from the generation config (falls back to the model config)."""
        model, _ = self._loaded()
        eos = getattr(model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = self.config.eos_token_id
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)


def _token_logprobs(logits: torch.Tensor, request_ids: list[str], requests: list[_Request],
                    tokens: list[int]) -> dict[str, TokenLogprobs]:
    """The rows whose requests ask for logprobs: log_softmax of the raw logits (the model's
    distribution, before the request's processors and temperature, which `_sample` applies to a
    copy), the chosen token's entry and the k largest."""
    rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    if not rows:
        return {}
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
    chosen = torch.tensor([[tokens[i]] for i in rows], device=logprobs.device)
    picked = logprobs.gather(1, chosen)[:, 0].tolist()
    k = max(requests[i].params.logprobs or 0 for i in rows)
    top_v, top_i = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0])
    top_v, top_i = top_v.tolist(), top_i.long().tolist()
    out = {}
    for j, i in enumerate(rows):
        n = requests[i].params.logprobs or 0
        out[request_ids[i]] = TokenLogprobs(picked[j], tuple(zip(top_i[j][:n], top_v[j][:n])))
    return out


def _process_logits(logits: torch.Tensor, requests: list[_Request]) -> torch.Tensor:
    """The per-request logit processors, on a float32 copy when any row needs one, in vLLM's
    order: logit_bias, the EOS ban of min_tokens, then the penalties; last, the output
    grammars' token masks."""
    rows = [(i, r.params) for i, r in enumerate(requests) if _processed(r)]
    constrained = [(i, r.grammar) for i, r in enumerate(requests) if r.grammar is not None]
    if not rows and not constrained:
        return logits
    logits = logits.to(torch.float32, copy=True)  # the model's output stays as it was
    vocab = logits.shape[-1]
    for i, params in rows:
        add_logit_bias(logits[i], params.logit_bias)
        if requests[i].generated < params.min_tokens:
            eos = [t for t in params.eos_token_ids if 0 <= t < vocab]
            logits[i, eos] = float("-inf")
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(requests[i].tokens)), device=logits.device)
            score = logits[i, seen]
            # As Hugging Face's RepetitionPenaltyLogitsProcessor: the penalty always lowers.
            logits[i, seen] = torch.where(score < 0, score * params.repetition_penalty,
                                          score / params.repetition_penalty)
        penalize_output(logits[i], requests[i].output, params.presence_penalty,
                        params.frequency_penalty)
    mask_rows(logits, constrained)
    return logits


def _processed(request: _Request) -> bool:
    """Some logit processor changes this request's logits now."""
    p = request.params
    return (p.repetition_penalty != 1.0 or request.generated < p.min_tokens or bool(p.logit_bias)
            or p.presence_penalty != 0 or p.frequency_penalty != 0)


def _keep_top_k(sorted_probs: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Zero all but each row's k most likely (sorted) tokens and renormalise, so top-p then
    works on the top-k distribution (the order vLLM and Hugging Face apply them in)."""
    vocab = sorted_probs.shape[-1]
    k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k], device=sorted_probs.device)
    kept = sorted_probs * (torch.arange(vocab, device=sorted_probs.device)[None, :] < k[:, None])
    return kept / kept.sum(dim=-1, keepdim=True)


def _uniform(seed: int, position: int) -> float:
    """A uniform draw in [0, 1) fixed by (seed, position): reproducible and resumable."""
    generator = torch.Generator().manual_seed((seed * 0x9E3779B1 + position) % 2**63)
    return torch.rand((), generator=generator, dtype=torch.float64).item()
