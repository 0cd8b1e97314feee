"""The model registry: `ModelRecord`s in one Redis hash (`MODELS_HASH`, field = the model's id).

The gateway's admin API writes it; the gateway and the placer read it. Visibility rule, in one
place: a tenant sees public models (owner None) and its own private ones.

Private names are per tenant: two tenants may each own a private "foo". A record's `name` is its
stable id, the one the placer, the nodes and the metrics know it by: a public model's name as
given, a private model's `<owner>~<name>` (`model_id`; "~" is not allowed in names, so no id is
ever another model's name). Clients call a model by the name its owner gave it
(`display_name`); the gateway resolves that for the caller's tenant (`resolve`).

An alias is one more name for a model, with the model's owner and so its visibility: a public
model's aliases are public, a private model's are private to its owner. Aliases live in their own
hash (`ALIASES_HASH`: alias id -> model id), so the placer and the nodes never see them: a request
for an alias is the model's request once the gateway resolved it (`resolve_served`).

`model_record_from_dir` turns a Hugging Face directory into a record: it reads `config.json`
(and `generation_config.json`, safetensors headers) for the numbers the placer sizes memory with.
"""

from __future__ import annotations

import json
import re
import struct
import time
import uuid
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from shared import wire
from shared.core.types import SLO_CLASSES
from shared.redis_client import write_confirmed
from shared.schemas import ModelRecord
from shared.subjects import ALIASES_HASH, MODELS_HASH, STATE_EPOCH_KEY

ENGINES = ("torch", "openvino", "vllm")

# dtype name (config.json / safetensors header) -> bytes per element
_DTYPE_BYTES = {
    "float32": 4, "F32": 4, "fp32": 4,
    "float16": 2, "F16": 2, "fp16": 2, "half": 2,
    "bfloat16": 2, "BF16": 2, "bf16": 2,
    "float64": 8, "F64": 8,
    "int8": 1, "I8": 1, "uint8": 1, "U8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "I32": 4, "I64": 8, "BOOL": 1,
}


class ModelExistsError(Exception):
    """A model of that name is registered already (and `replace` was not asked for)."""


class ModelDirError(ValueError):
    """The directory is not a usable Hugging Face model (or adapter) directory."""


PRIVATE_SEPARATOR = "~"


def visible_to(record: ModelRecord, tenant: str) -> bool:
    return record.owner is None or record.owner == tenant


def model_id(name: str, owner: str | None) -> str:
    """The registry id of `owner`'s private model `name`, or of the public model `name`."""
    return name if owner is None else f"{owner}{PRIVATE_SEPARATOR}{name}"


def strip_owner(name_or_id: str, owner: str | None) -> str:
    """`name_or_id` as `owner` calls it: its own ids lose the owner prefix; other names stay."""
    prefix = None if owner is None else f"{owner}{PRIVATE_SEPARATOR}"
    return name_or_id[len(prefix):] if prefix and name_or_id.startswith(prefix) else name_or_id


def display_name(record: ModelRecord) -> str:
    """The name the model's owner (everyone, for a public model) calls it by."""
    return strip_owner(record.name, record.owner)


class ModelRegistry:
    """Async access to the registry hash. Collaborator: an open `redis.asyncio.Redis`."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis

    async def register(self, record: ModelRecord, *, replace: bool = False) -> ModelRecord:
        data = wire.encode(record)
        what = f"registering {record.name}"
        if replace:
            await write_confirmed(self._redis, what,
                                  lambda p: p.hset(MODELS_HASH, record.name, data))
        elif not (await write_confirmed(self._redis, what,
                                        lambda p: p.hsetnx(MODELS_HASH, record.name, data)))[0]:
            raise ModelExistsError(f"model {record.name!r} is already registered")
        return record

    async def get(self, name: str) -> ModelRecord | None:
        data = await self._redis.hget(MODELS_HASH, name)
        return None if data is None else wire.decode(ModelRecord, data)

    async def resolve(self, name: str, tenant: str) -> ModelRecord | None:
        """The model `tenant` means by `name`: its own private one, else a public one. None when
        neither exists *or* the only match is private to someone else (the same answer, so
        names never leak)."""
        if PRIVATE_SEPARATOR not in name:
            own = await self.get(model_id(name, tenant))
            if own is not None and own.owner == tenant:
                return own
        record = await self.get(name)
        # A record stored under a bare name by an older gateway may be private: visibility says.
        return record if record is not None and visible_to(record, tenant) else None

    async def resolve_served(self, name: str, tenant: str) -> ModelRecord | None:
        """The model a request for `name` by `tenant` is served by: `resolve`'s model, else the
        model of `tenant`'s own alias, else of a public alias. A model costs one read (both of
        its possible ids in one HMGET: one round trip fewer than `resolve` for a public model);
        an alias two more (its id, then its model); a name that is neither, one more."""
        fields = [name] if PRIVATE_SEPARATOR in name else [model_id(name, tenant), name]
        for field, data in zip(fields, await self._redis.hmget(MODELS_HASH, fields)):
            if data is not None:
                record = wire.decode(ModelRecord, data)
                if visible_to(record, tenant) and (field == name or record.owner == tenant):
                    return record
        for target in await self._redis.hmget(ALIASES_HASH, fields):
            if target is not None:
                record = await self.get(_text(target))
                # an alias is visible to whoever sees its model, and to no one else
                if record is not None and visible_to(record, tenant):
                    return record
        return None

    async def add_alias(self, alias: str, model: ModelRecord) -> str:
        """Name `model` also `alias` (with the model's owner). Returns the alias's id; raises
        ModelExistsError when that alias exists (for any model)."""
        alias_id = model_id(alias, model.owner)
        added, = await write_confirmed(self._redis, f"aliasing {model.name} as {alias_id}",
                                       lambda p: p.hsetnx(ALIASES_HASH, alias_id, model.name))
        if not added:
            raise ModelExistsError(f"alias {alias_id!r} exists already")
        return alias_id

    async def aliases(self) -> dict[str, str]:
        """Every alias: alias id -> the registry id of its model."""
        raw = await self._redis.hgetall(ALIASES_HASH)
        return {_text(k): _text(v) for k, v in raw.items()}

    async def remove_aliases(self, *alias_ids: str) -> int:
        if not alias_ids:
            return 0
        removed, = await write_confirmed(self._redis, f"removing aliases {list(alias_ids)}",
                                         lambda p: p.hdel(ALIASES_HASH, *alias_ids))
        return int(removed)

    async def get_visible(self, name: str, tenant: str) -> ModelRecord | None:
        """`resolve`, by its older name."""
        return await self.resolve(name, tenant)

    async def list(self, tenant: str | None = None) -> list[ModelRecord]:
        """All records (tenant None) or those visible to `tenant`, sorted by name."""
        return records_of(await self._redis.hgetall(MODELS_HASH), tenant)

    async def delete(self, name: str) -> bool:
        removed, = await write_confirmed(self._redis, f"deleting {name}",
                                         lambda p: p.hdel(MODELS_HASH, name))
        return bool(removed)

    async def mark_intact(self) -> None:
        """Mark this Redis as holding the durable state, unless it is marked already (a service
        starting on a fresh Redis). See `STATE_EPOCH_KEY`."""
        await self._redis.set(STATE_EPOCH_KEY, uuid.uuid4().hex, nx=True)

    async def intact(self) -> bool:
        """False while Redis has lost its data and no placer has restored the registry yet: a
        model missing now may only be missing for a moment (503, not 404)."""
        return bool(await self._redis.exists(STATE_EPOCH_KEY))


def records_of(raw: dict, tenant: str | None = None) -> list[ModelRecord]:
    """The records of MODELS_HASH's contents `raw` (all, or those visible to `tenant`), sorted
    by name. A record that does not decode (a foreign writer, an old schema) is skipped, not
    fatal."""
    records = []
    for data in raw.values():
        try:
            record = wire.decode(ModelRecord, data)
        except wire.WireError:
            continue
        if tenant is None or visible_to(record, tenant):
            records.append(record)
    return sorted(records, key=lambda r: r.name)


def aliases_of(aliases: dict[str, str], model: str) -> list[str]:
    """The ids of `model`'s aliases (from `ModelRegistry.aliases`), sorted."""
    return sorted(a for a, target in aliases.items() if target == model)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


# --- reading a model directory -------------------------------------------------------------------


def model_record_from_dir(
    name: str,
    path: str | Path,
    *,
    engine: str = "torch",
    slo_class: str = "standard",
    owner: str | None = None,
    base: ModelRecord | None = None,
    created_at: float | None = None,
) -> ModelRecord:
    """Build a record from a Hugging Face directory, validating it on the way.

    For a LoRA adapter pass `base` (the base model's record): the adapter directory needs an
    `adapter_config.json`; context, KV size and EOS come from the base, weight bytes from the
    adapter's own files.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {list(ENGINES)}, got {engine!r}")
    if slo_class not in SLO_CLASSES:
        raise ValueError(f"slo_class must be one of {sorted(SLO_CLASSES)}, got {slo_class!r}")
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise ModelDirError(f"model directory {str(directory)!r} does not exist")
    created = time.time() if created_at is None else created_at

    if base is not None:
        if not (directory / "adapter_config.json").is_file():
            raise ModelDirError(f"{str(directory)!r} has no adapter_config.json (LoRA adapter expected)")
        adapter_config = _read_json(directory / "adapter_config.json")
        rank = adapter_config.get("r", 0)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ModelDirError(f"{str(directory)!r}: adapter_config.json's r must be a rank, "
                                f"not {rank!r}")
        return ModelRecord(
            name=name, path=str(directory.resolve()), engine=engine, slo_class=slo_class,
            owner=owner, base_model=base.name, max_context=base.max_context,
            weight_bytes=_weight_bytes_from_files(directory) or 0,
            kv_bytes_per_token=base.kv_bytes_per_token,
            eos_token_ids=list(base.eos_token_ids), created_at=created, lora_rank=rank,
        )

    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelDirError(f"{str(directory)!r} has no config.json (not a Hugging Face model directory)")
    config = _read_json(config_path)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config

    layers = _positive_int(text, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _positive_int(text, "hidden_size", "n_embd", "d_model")
    heads = _positive_int(text, "num_attention_heads", "n_head")
    kv_heads = _optional_int(text, "num_key_value_heads") or heads
    head_dim = _optional_int(text, "head_dim") or hidden // heads
    max_context = _optional_int(text, "max_position_embeddings", "n_positions", "max_seq_len") or 2048

    dtype_bytes = _dtype_bytes(config, directory)
    kv_bytes_per_token = 2 * layers * kv_heads * head_dim * dtype_bytes
    weight_bytes = _weight_bytes_from_files(directory)
    if weight_bytes is None:
        weight_bytes = _estimate_param_count(text, layers, hidden, heads, kv_heads, head_dim) * dtype_bytes
    head_bytes = _head_bytes_from_files(directory)
    if head_bytes is None:
        vocab = _optional_int(text, "vocab_size") or 32000
        tied = 1 if text.get("tie_word_embeddings") else 2
        head_bytes = (vocab * hidden * tied + hidden) * dtype_bytes

    return ModelRecord(
        name=name, path=str(directory.resolve()), engine=engine, slo_class=slo_class, owner=owner,
        base_model=None, max_context=max_context, weight_bytes=weight_bytes,
        kv_bytes_per_token=kv_bytes_per_token, eos_token_ids=_eos_ids(config, directory),
        created_at=created, layers=layers, head_bytes=min(head_bytes, weight_bytes),
        token_bytes=hidden * dtype_bytes,
    )


def files_problem(path: str | Path, adapter: bool = False) -> str | None:
    """What keeps the model (or LoRA adapter) directory at `path` from being loaded, in words
    that name the path: gone, unreadable, its config or a weight file broken or truncated. None
    when its files look whole. A node asks after a load failed, to tell a broken directory (the
    model cannot be served until someone fixes it) from any other failure."""
    directory = Path(path)
    try:
        if not directory.is_dir():
            return f"{path} does not exist or is not a directory"
        config = "adapter_config.json" if adapter else "config.json"
        if not (directory / config).is_file():
            return f"{path} has no {config}"
        _read_json(directory / config)
        weights = sorted(directory.glob("adapter_model.*" if adapter else "*"))
        weights = [w for w in weights if w.suffix in (".safetensors", ".bin")]
        if not weights:
            return f"{path} has no weight files (*.safetensors or *.bin)"
        for file in weights:
            _check_weight_file(file)
    except ModelDirError as exc:
        return f"{path}: {exc}"
    except OSError as exc:
        return f"{path}: {exc}"
    return None


def _check_weight_file(file: Path) -> None:
    """Raise ModelDirError unless `file` can be read and, for safetensors, holds every byte its
    header promises (a copy cut short loads as garbage or not at all)."""
    if file.suffix != ".safetensors":
        with file.open("rb") as fh:
            fh.read(1)
        return
    length, header = _safetensors_header(file)
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"
            and isinstance(t, dict) and isinstance(t.get("data_offsets"), list)
            and len(t["data_offsets"]) == 2 and isinstance(t["data_offsets"][1], int)]
    expected, size = 8 + length + max(ends, default=0), file.stat().st_size
    if size < expected:
        raise ModelDirError(f"{file.name} is truncated ({size} of {expected} bytes)")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelDirError(f"cannot read {path.name}: {exc}") from exc
    if not isinstance(value, dict):
        raise ModelDirError(f"{path.name} is not a JSON object")
    return value


def _optional_int(config: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelDirError(f"config.json: {key} must be a positive integer, got {value!r}")
        return value
    return None


def _positive_int(config: dict[str, Any], *keys: str) -> int:
    value = _optional_int(config, *keys)
    if value is None:
        raise ModelDirError(f"config.json lacks {keys[0]}")
    return value


def _dtype_bytes(config: dict[str, Any], directory: Path) -> int:
    for key in ("torch_dtype", "dtype"):
        name = config.get(key)
        if isinstance(name, str):
            name = name.removeprefix("torch.")
            if name in _DTYPE_BYTES:
                return _DTYPE_BYTES[name]
    for header in _safetensors_headers(directory):
        for tensor in header.values():
            if isinstance(tensor, dict) and tensor.get("dtype") in _DTYPE_BYTES:
                return _DTYPE_BYTES[tensor["dtype"]]
    return 2  # Hugging Face checkpoints are 16-bit unless they say otherwise


def _safetensors_headers(directory: Path) -> list[dict[str, Any]]:
    return [_safetensors_header(file)[1] for file in sorted(directory.glob("*.safetensors"))]


def _safetensors_header(file: Path) -> tuple[int, dict[str, Any]]:
    """(length, header) of a safetensors file's JSON header."""
    try:
        with file.open("rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            if length > 100 << 20:
                raise ModelDirError(f"{file.name}: implausible safetensors header ({length} bytes)")
            header = json.loads(fh.read(length))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelDirError(f"{file.name} is not a safetensors file: {exc}") from exc
    if not isinstance(header, dict):
        raise ModelDirError(f"{file.name} is not a safetensors file: its header is not an object")
    return length, header


def _weight_bytes_from_files(directory: Path) -> int | None:
    """Tensor bytes from the safetensors headers; else the size of pytorch .bin files; else None."""
    headers = _safetensors_headers(directory)
    if headers:
        total = 0
        for header in headers:
            for key, tensor in header.items():
                if key != "__metadata__" and isinstance(tensor, dict) and "data_offsets" in tensor:
                    start, end = tensor["data_offsets"]
                    total += end - start
        return total
    bins = list(directory.glob("*.bin"))
    return sum(b.stat().st_size for b in bins) if bins else None


def _head_bytes_from_files(directory: Path) -> int | None:
    """Bytes of the tensors that are not a decoder layer's (embeddings, final norm, head), from
    the safetensors headers; None without them."""
    headers = _safetensors_headers(directory)
    if not headers:
        return None
    total = 0
    for header in headers:
        for key, tensor in header.items():
            if key != "__metadata__" and isinstance(tensor, dict) and "data_offsets" in tensor \
                    and not _LAYER_TENSOR.match(key):
                start, end = tensor["data_offsets"]
                total += end - start
    return total


_LAYER_TENSOR = re.compile(r"^(model\.)?layers\.\d+\.")


def _estimate_param_count(
    config: dict[str, Any], layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int
) -> int:
    """Decoder-only transformer parameter count (Llama layout) when no weight files are present."""
    vocab = _optional_int(config, "vocab_size") or 32000
    intermediate = _optional_int(config, "intermediate_size") or 4 * hidden
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o, k, v
    mlp = 3 * hidden * intermediate  # gate, up, down
    per_layer = attention + mlp + 2 * hidden  # two norms
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return layers * per_layer + embeddings + hidden


def _eos_ids(config: dict[str, Any], directory: Path) -> list[int]:
    sources = [config]
    if (directory / "generation_config.json").is_file():
        sources.append(_read_json(directory / "generation_config.json"))
    ids: list[int] = []
    for source in sources:
        value = source.get("eos_token_id")
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and not isinstance(token, bool) and token not in ids:
                ids.append(token)
    return ids
