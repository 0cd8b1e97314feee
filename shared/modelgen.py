"""Build random-weight Hugging Face model directories offline (no model hub is reachable here).

`slinfer make-model --shape SHAPE --out DIR` writes a directory that
`AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)` load:
config.json, generation_config.json, safetensors shards, and a byte-level BPE tokenizer trained
here on a corpus made from the docstrings of standard-library modules. Shapes: `tiny` and `small`
(tests and the demo, float32), `tiny-qwen2` (the tiny size in the Qwen2 architecture, for tests),
and the real models' shapes `llama-3.2-1b`, `qwen2.5-0.5b`, `llama-3.2-3b`, `llama-2-7b`,
`llama-2-13b`, stored in bfloat16 as their published checkpoints are.

Weights are random (nonsense text, real timings). Everything is seeded and deterministic. Weights
are generated tensor by tensor straight into safetensors shards, never as a whole nn.Module, so a
7B model needs about one shard of memory rather than twice the model.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.model_dirs import publish_dir

SHAPES = ("tiny", "small", "tiny-qwen2", "llama-3.2-1b", "qwen2.5-0.5b", "llama-3.2-3b",
          "llama-2-7b", "llama-2-13b")
ARCHITECTURES = ("llama", "qwen2")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Special tokens get the first ids, in this order.
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
SPECIAL_TOKENS = (BOS, EOS, PAD, *ROLE_TOKENS)

# Each message is "<|role|>\ncontent<|end|>\n"; the generation prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

MARKER = "slinfer-model.json"  # written last: its presence means the directory is complete
SHARD_BYTES = 2 * 1024**3

# Standard-library modules whose docstrings make the tokenizer corpus: pure-Python, importable
# without side effects, and stable within a Python version.
CORPUS_MODULES = (
    "abc", "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "collections",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib",
    "email.message", "enum", "fractions", "functools", "glob", "gzip", "hashlib", "heapq", "hmac",
    "html.parser", "http.client", "http.server", "inspect", "io", "ipaddress", "itertools", "json",
    "logging", "mailbox", "math", "operator", "optparse", "os", "pathlib", "pickle", "pprint",
    "queue", "random", "re", "sched", "secrets", "selectors", "shlex", "shutil", "socket",
    "sqlite3", "statistics", "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap",
    "threading", "time", "timeit", "tokenize", "traceback", "typing", "unittest", "urllib.parse",
    "urllib.request", "uuid", "warnings", "weakref", "xml.dom.minidom", "zipfile", "zlib",
)


@dataclass(frozen=True)
class Shape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    vocab_size: int | None  # None: the tokenizer's size (tiny)
    tokenizer_vocab: int  # BPE vocabulary trained for this shape
    rms_norm_eps: float = 1e-5
    rope_parameters: dict | None = None
    tie_word_embeddings: bool = False
    init_std: float = 0.02
    architecture: str = "llama"  # "qwen2": Qwen2ForCausalLM (q/k/v projections with biases)
    default_dtype: str = "float32"  # what `make-model` writes unless --dtype says otherwise


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}

# The real models' config numbers (Meta's and Qwen's published config.json files); their
# published checkpoints are bfloat16, so these are written in bfloat16 by default.
SHAPE_SPECS: dict[str, Shape] = {
    # A larger init std sharpens the logits of the tiny random model, so greedy argmax has clear
    # margins and CPU/GPU numeric noise does not flip tokens in tests.
    "tiny": Shape(128, 352, 4, 4, 2, 2048, None, 2048,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, init_std=0.06),
    # ~46M parameters (185 MB in float32): a CPU prefill of 256 tokens takes ~0.12 s on a 2-core
    # AVX-512 box, a time to first token of a realistic order, still inside the 0.5 s TTFT SLO.
    "small": Shape(512, 1536, 12, 8, 4, 2048, None, 8192,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # The tiny size in the Qwen2 architecture: tests that an engine handles q/k/v biases.
    "tiny-qwen2": Shape(128, 352, 4, 4, 2, 2048, None, 2048, rms_norm_eps=1e-6,
                        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                        tie_word_embeddings=True, init_std=0.06, architecture="qwen2"),
    "llama-3.2-1b": Shape(2048, 8192, 16, 32, 8, 131072, 128256, 16384,
                          rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True,
                          default_dtype="bfloat16"),
    "qwen2.5-0.5b": Shape(896, 4864, 24, 14, 2, 32768, 151936, 16384, rms_norm_eps=1e-6,
                          rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                          tie_word_embeddings=True, architecture="qwen2",
                          default_dtype="bfloat16"),
    "llama-3.2-3b": Shape(3072, 8192, 28, 24, 8, 131072, 128256, 16384,
                          rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True,
                          default_dtype="bfloat16"),
    "llama-2-7b": Shape(4096, 11008, 32, 32, 32, 4096, 32000, 16384,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                        default_dtype="bfloat16"),
    "llama-2-13b": Shape(5120, 13824, 40, 40, 40, 4096, 32000, 16384,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                         default_dtype="bfloat16"),
}


# ---------------------------------------------------------------------------------------------
# Tokenizer


def corpus_lines() -> Iterator[str]:
    """Docstrings of stdlib modules and their public members, in a fixed order."""
    for module_name in CORPUS_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # e.g. a Python built without sqlite3: skip, stay deterministic
            continue
        with warnings.catch_warnings():  # touching deprecated members (typing.io) warns
            warnings.simplefilter("ignore", DeprecationWarning)
            yield from _docstrings(module)


def _docstrings(module) -> Iterator[str]:
    yield inspect.getdoc(module) or ""
    for name in sorted(vars(module)):
        if name.startswith("_"):
            continue
        member = getattr(module, name)
        if inspect.isclass(member) or inspect.isfunction(member):
            yield f"{name}: {inspect.getdoc(member) or ''}"
        if inspect.isclass(member):
            for attr in sorted(vars(member)):
                if not attr.startswith("_") and callable(getattr(member, attr, None)):
                    yield f"{name}.{attr}: {inspect.getdoc(getattr(member, attr)) or ''}"


def train_tokenizer(vocab_size: int):
    """A byte-level BPE (any text round-trips) with BOS prepended by the post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus_lines(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return tokenizer


def save_tokenizer(tokenizer, out_dir: Path, model_max_length: int) -> None:
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": None,
        "additional_special_tokens": list(ROLE_TOKENS),
        "add_bos_token": True, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special_map = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
                   "additional_special_tokens": list(ROLE_TOKENS)}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# Config and weights


def model_config(shape: str, vocab_size: int | None = None, dtype: str | None = None):
    """The HF config of a shape (LlamaConfig or Qwen2Config); only the shapes without a vocabulary
    of their own (`tiny`, `small`, `tiny-qwen2`) need `vocab_size` (their tokenizer's size)."""
    spec = _spec(shape)
    vocab = spec.vocab_size or vocab_size
    if vocab is None:
        raise ValueError(f"shape {shape!r} takes its vocabulary size from the tokenizer")
    common = dict(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        rope_parameters=dict(spec.rope_parameters or {}),
        tie_word_embeddings=spec.tie_word_embeddings,
        initializer_range=spec.init_std,
        hidden_act="silu",
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        dtype=dtype or spec.default_dtype,
    )
    if spec.architecture == "qwen2":
        from transformers import Qwen2Config

        # Qwen2's head size is always hidden / heads (its config has no head_dim).
        return Qwen2Config(use_sliding_window=False, **common)
    from transformers import LlamaConfig

    return LlamaConfig(head_dim=spec.hidden_size // spec.num_attention_heads, **common)


def weight_specs(config) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, init) of every parameter of LlamaForCausalLM / Qwen2ForCausalLM; init is
    "normal" or "ones"."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_out = config.num_attention_heads * head_dim
    kv_out = config.num_key_value_heads * head_dim
    qkv_bias = config.model_type == "qwen2"  # Qwen2: biases on q/k/v (not o)
    specs = [("model.embed_tokens.weight", (config.vocab_size, hidden), "normal")]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        specs += [(p + "input_layernorm.weight", (hidden,), "ones")]
        for proj, out in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
            specs.append((p + f"self_attn.{proj}.weight", (out, hidden), "normal"))
            if qkv_bias:
                specs.append((p + f"self_attn.{proj}.bias", (out,), "normal"))
        specs += [
            (p + "self_attn.o_proj.weight", (hidden, q_out), "normal"),
            (p + "post_attention_layernorm.weight", (hidden,), "ones"),
            (p + "mlp.gate_proj.weight", (inter, hidden), "normal"),
            (p + "mlp.up_proj.weight", (inter, hidden), "normal"),
            (p + "mlp.down_proj.weight", (hidden, inter), "normal"),
        ]
    specs.append(("model.norm.weight", (hidden,), "ones"))
    if not config.tie_word_embeddings:
        specs.append(("lm_head.weight", (config.vocab_size, hidden), "normal"))
    return specs


def _make_tensor(name: str, shape: tuple[int, ...], init: str, std: float, seed: int,
                 dtype: torch.dtype) -> torch.Tensor:
    if init == "ones":
        return torch.ones(shape, dtype=dtype)
    # One generator per tensor, seeded from the name: the values do not depend on shard layout.
    name_seed = (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63
    generator = torch.Generator().manual_seed(name_seed)
    return (torch.randn(shape, generator=generator) * std).to(dtype)


def write_weights(config, out_dir: Path, dtype: torch.dtype, seed: int,
                  shard_bytes: int = SHARD_BYTES) -> None:
    """Generate tensors one at a time into safetensors shards (+ an index when more than one)."""
    from safetensors.torch import save_file

    specs = weight_specs(config)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    shards: list[list[tuple[str, tuple[int, ...], str]]] = [[]]
    size = 0
    for spec in specs:
        nbytes = _numel(spec[1]) * itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map = {}
    for file_name, shard in zip(names, shards):
        tensors = {name: _make_tensor(name, shape, init, config.initializer_range, seed, dtype)
                   for name, shape, init in shard}
        save_file(tensors, str(out_dir / file_name), metadata={"format": "pt"})
        del tensors  # free this shard before generating the next
        weight_map.update({name: file_name for name, _, _ in shard})
    if len(shards) > 1:
        total = sum(_numel(shape) * itemsize for _, shape, _ in specs)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---------------------------------------------------------------------------------------------
# Public API


def build_model(shape: str, out_dir: Path, dtype: str | None = None, seed: int = 0) -> Path:
    """Write a complete random-weight model directory for `shape` into `out_dir` (in the shape's
    default dtype unless `dtype` is given)."""
    from transformers import GenerationConfig

    spec = _spec(shape)
    dtype = dtype or spec.default_dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MARKER).unlink(missing_ok=True)

    tokenizer = train_tokenizer(spec.tokenizer_vocab)
    n_tokens = tokenizer.get_vocab_size()
    config = model_config(shape, vocab_size=n_tokens, dtype=dtype)
    if n_tokens > config.vocab_size:  # every tokenizer id must index the embedding
        raise RuntimeError(f"tokenizer has {n_tokens} ids, model vocab is {config.vocab_size}")
    save_tokenizer(tokenizer, out_dir, spec.max_position_embeddings)
    config.save_pretrained(out_dir)
    eos_ids = [SPECIAL_TOKENS.index(EOS), SPECIAL_TOKENS.index("<|end|>")]
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=eos_ids,
                     pad_token_id=config.pad_token_id).save_pretrained(out_dir)
    write_weights(config, out_dir, DTYPES[dtype], seed)
    marker = {"shape": shape, "dtype": dtype, "seed": seed, "tokenizer_vocab": n_tokens}
    (out_dir / MARKER).write_text(json.dumps(marker) + "\n")
    return out_dir


def is_built(model_dir: Path, shape: str | None = None) -> bool:
    marker = Path(model_dir) / MARKER
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return shape is None or info.get("shape") == shape


def ensure_demo_model(data_dir: Path) -> Path:
    """The tiny demo model under data_dir/models/tiny-llama, built once (a file check after)."""
    return ensure_model(data_dir, "tiny", "tiny-llama")


def ensure_model(data_dir: Path, shape: str, name: str) -> Path:
    """A `shape` model under data_dir/models/`name`, built once (a file check after)."""
    target = Path(data_dir) / "models" / name
    if is_built(target, shape):
        return target
    return publish_dir(target, lambda staging: build_model(shape, staging),
                       lambda t: is_built(t, shape))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="slinfer make-model",
        description="Build a random-weight Hugging Face model directory and tokenizer offline.")
    parser.add_argument("--shape", required=True, choices=SHAPES)
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--dtype", choices=sorted(DTYPES),
                        help="weights on disk (default: float32 for tiny/small/tiny-qwen2, "
                             "bfloat16 for the real shapes)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    dtype = args.dtype or _spec(args.shape).default_dtype
    path = build_model(args.shape, args.out, dtype=dtype, seed=args.seed)
    print(f"built {args.shape} ({dtype}, seed {args.seed}) in {path}")
    return 0


def _spec(shape: str) -> Shape:
    try:
        return SHAPE_SPECS[shape]
    except KeyError:
        raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}") from None


if __name__ == "__main__":
    sys.exit(main())
