"""shared.registry: records from Hugging Face directories, and the Redis registry itself."""

from __future__ import annotations

import json
import struct

import pytest
from redis.asyncio import Redis

from shared.registry import (
    ModelDirError,
    ModelExistsError,
    ModelRegistry,
    display_name,
    files_problem,
    model_id,
    model_record_from_dir,
    strip_owner,
)
from shared.schemas import ModelRecord
from shared.subjects import MODELS_HASH


def test_record_from_tiny_model(model_dir):
    rec = model_record_from_dir("tiny", model_dir, engine="vllm", slo_class="relaxed", owner="t")
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    # float32 tiny model: 2 (K and V) * layers * kv heads * head dim * 4 bytes
    assert rec.kv_bytes_per_token == 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    assert rec.max_context == config["max_position_embeddings"]
    # Tensor bytes from the safetensors headers: just under the files' total size.
    files = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    assert files - 100_000 < rec.weight_bytes <= files
    assert config["eos_token_id"] in rec.eos_token_ids and len(rec.eos_token_ids) == 2  # + <|end|>
    assert (rec.engine, rec.slo_class, rec.owner, rec.base_model) == ("vllm", "relaxed", "t", None)


def test_record_without_weight_files_estimates_from_config(tmp_path):
    config = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100,
              "max_position_embeddings": 512, "torch_dtype": "bfloat16", "eos_token_id": [2, 3]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    rec = model_record_from_dir("m", tmp_path)
    assert rec.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64
    assert rec.weight_bytes == (2 * per_layer + 100 * 64 * 2 + 64) * 2
    assert rec.eos_token_ids == [2, 3] and rec.max_context == 512


def test_weight_bytes_from_safetensors_header(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 1, "hidden_size": 8, "num_attention_heads": 2}))
    header = json.dumps({"a": {"dtype": "F16", "shape": [4, 8], "data_offsets": [0, 64]},
                         "__metadata__": {"format": "pt"}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 64)
    rec = model_record_from_dir("m", tmp_path)
    assert rec.weight_bytes == 64 and rec.kv_bytes_per_token == 2 * 1 * 2 * 4 * 2  # dtype from header


@pytest.mark.parametrize(("files", "match"), [
    ({}, "config.json"),
    ({"config.json": "{not json"}, "config.json"),
    ({"config.json": "[]"}, "JSON object"),
    ({"config.json": json.dumps({"hidden_size": 8, "num_attention_heads": 2})}, "num_hidden_layers"),
    ({"config.json": json.dumps({"num_hidden_layers": -1, "hidden_size": 8, "num_attention_heads": 2})},
     "positive"),
    ({"config.json": json.dumps({"num_hidden_layers": 1, "hidden_size": 8, "num_attention_heads": 2}),
      "model.safetensors": "garbage"}, "safetensors"),
])
def test_bad_directories(tmp_path, files, match):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ModelDirError, match=match):
        model_record_from_dir("m", tmp_path)


def test_missing_directory_and_bad_options(tmp_path):
    with pytest.raises(ModelDirError, match="does not exist"):
        model_record_from_dir("m", tmp_path / "nope")
    with pytest.raises(ValueError, match="engine"):
        model_record_from_dir("m", tmp_path, engine="onnx")
    with pytest.raises(ValueError, match="slo_class"):
        model_record_from_dir("m", tmp_path, slo_class="gold")


def test_adapter_needs_adapter_config(tmp_path):
    base = ModelRecord(name="b", path="/x", max_context=99, kv_bytes_per_token=7, eos_token_ids=[1])
    with pytest.raises(ModelDirError, match="adapter_config.json"):
        model_record_from_dir("a", tmp_path, base=base)
    (tmp_path / "adapter_config.json").write_text("{}")
    rec = model_record_from_dir("a", tmp_path, base=base)
    assert (rec.base_model, rec.max_context, rec.kv_bytes_per_token, rec.eos_token_ids) == ("b", 99, 7, [1])
    assert rec.lora_rank == 0  # no r: not known
    (tmp_path / "adapter_config.json").write_text('{"r": 16}')
    assert model_record_from_dir("a", tmp_path, base=base).lora_rank == 16  # its iterations' cost
    (tmp_path / "adapter_config.json").write_text('{"r": "big"}')
    with pytest.raises(ModelDirError, match="r must be a rank"):
        model_record_from_dir("a", tmp_path, base=base)


def _safetensors(path, data_bytes: int, cut: int = 0) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [data_bytes // 4],
                               "data_offsets": [0, data_bytes]}}).encode()
    path.write_bytes((struct.pack("<Q", len(header)) + header + b"\0" * data_bytes)[:-cut or None])


def test_files_problem_names_what_keeps_a_directory_from_loading(tmp_path):
    """A whole directory has none; each fault a load can meet is named with the path."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    _safetensors(model / "model.safetensors", 64)
    assert files_problem(model) is None
    _safetensors(model / "model.safetensors", 64, cut=10)
    size = (model / "model.safetensors").stat().st_size
    assert files_problem(model) == \
        f"{model}: model.safetensors is truncated ({size} of {size + 10} bytes)"
    (model / "model.safetensors").write_bytes(b"garbage")
    assert "model.safetensors is not a safetensors file" in files_problem(model)
    (model / "model.safetensors").unlink()
    assert files_problem(model) == f"{model} has no weight files (*.safetensors or *.bin)"
    (model / "pytorch_model.bin").write_bytes(b"\0")
    assert files_problem(model) is None
    (model / "config.json").write_text("{ not json")
    assert "cannot read config.json" in files_problem(model)
    (model / "config.json").unlink()
    assert files_problem(model) == f"{model} has no config.json"
    gone = tmp_path / "gone"
    assert files_problem(gone) == f"{gone} does not exist or is not a directory"

    adapter = tmp_path / "a"
    adapter.mkdir()
    (adapter / "config.json").write_text("{}")  # an adapter's config is adapter_config.json
    assert files_problem(adapter, adapter=True) == f"{adapter} has no adapter_config.json"
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    assert "has no weight files" in files_problem(adapter, adapter=True)
    _safetensors(adapter / "adapter_model.safetensors", 32)
    assert files_problem(adapter, adapter=True) is None
    _safetensors(adapter / "adapter_model.safetensors", 32, cut=1)
    assert "adapter_model.safetensors is truncated" in files_problem(adapter, adapter=True)


def test_private_ids_and_display_names():
    assert model_id("org/m", None) == "org/m"
    assert model_id("org/m", "team:x") == "team:x~org/m"
    rec = ModelRecord(name=model_id("org/m", "team:x"), path="/p", owner="team:x")
    assert display_name(rec) == "org/m"
    assert display_name(ModelRecord(name="legacy", path="/p", owner="t")) == "legacy"
    assert strip_owner("t~base", "t") == "base" and strip_owner("public-base", "t") == "public-base"
    assert strip_owner("u~base", "t") == "u~base"  # another owner's id is not shortened


@pytest.mark.integration
async def test_resolve_prefers_the_tenants_own_then_public(redis_url):
    redis = Redis.from_url(redis_url)
    reg = ModelRegistry(redis)
    ids = ["res-x", model_id("res-x", "ta"), model_id("res-y", "tb"), "res-legacy"]
    try:
        await reg.register(ModelRecord(name="res-x", path="/public"))
        await reg.register(ModelRecord(name=model_id("res-x", "ta"), path="/ta", owner="ta"))
        await reg.register(ModelRecord(name=model_id("res-y", "tb"), path="/tb", owner="tb"))
        await reg.register(ModelRecord(name="res-legacy", path="/l", owner="ta"))  # older layout
        assert (await reg.resolve("res-x", "ta")).path == "/ta"
        assert (await reg.resolve("res-x", "tb")).path == "/public"
        assert (await reg.resolve("res-y", "tb")).path == "/tb"
        assert await reg.resolve("res-y", "ta") is None
        assert await reg.resolve(model_id("res-y", "tb"), "ta") is None  # ids do not get around it
        assert (await reg.resolve("res-legacy", "ta")).path == "/l"
        assert await reg.resolve("res-legacy", "tb") is None
        # A request resolves the same models the same way (in one read: resolve_served).
        for name, tenant in (("res-x", "ta"), ("res-x", "tb"), ("res-y", "tb"), ("res-y", "ta"),
                             (model_id("res-y", "tb"), "ta"), ("res-legacy", "ta"),
                             ("res-legacy", "tb")):
            assert await reg.resolve_served(name, tenant) == await reg.resolve(name, tenant)
    finally:
        await redis.hdel(MODELS_HASH, *ids)
        await redis.aclose()


@pytest.mark.integration
async def test_an_alias_serves_its_model_to_whoever_sees_the_model(redis_url):
    redis = Redis.from_url(redis_url)
    reg = ModelRegistry(redis)
    public = ModelRecord(name="al-pub", path="/public")
    private = ModelRecord(name=model_id("al-own", "ta"), path="/ta", owner="ta")
    try:
        for record in (public, private):
            await reg.register(record)
        assert await reg.add_alias("al-p", public) == "al-p"
        assert await reg.add_alias("al-q", private) == model_id("al-q", "ta")
        with pytest.raises(ModelExistsError):
            await reg.add_alias("al-p", public)
        assert (await reg.resolve_served("al-p", "tb")).path == "/public"
        assert (await reg.resolve_served("al-q", "ta")).path == "/ta"
        assert await reg.resolve_served("al-q", "tb") is None
        assert await reg.resolve_served(model_id("al-q", "ta"), "tb") is None  # nor by its id
        assert await reg.resolve("al-p", "tb") is None  # resolve: models only (the admin API's)
        assert await reg.aliases() == {"al-p": "al-pub", model_id("al-q", "ta"): private.name}
        assert await reg.remove_aliases("al-p", model_id("al-q", "ta")) == 2
        assert await reg.resolve_served("al-p", "tb") is None
    finally:
        await reg.remove_aliases("al-p", model_id("al-q", "ta"))
        await redis.hdel(MODELS_HASH, public.name, private.name)
        await redis.aclose()


@pytest.mark.integration
async def test_registry_crud_and_visibility(redis_url):
    redis = Redis.from_url(redis_url)
    reg = ModelRegistry(redis)
    names = ["reg-pub", "reg-a", "reg-b"]
    try:
        await reg.register(ModelRecord(name="reg-pub", path="/p"))
        await reg.register(ModelRecord(name="reg-a", path="/a", owner="ta"))
        await reg.register(ModelRecord(name="reg-b", path="/b", owner="tb"))
        with pytest.raises(ModelExistsError):
            await reg.register(ModelRecord(name="reg-a", path="/other"))
        await reg.register(ModelRecord(name="reg-a", path="/a2", owner="ta"), replace=True)
        assert (await reg.get("reg-a")).path == "/a2"
        seen_a = {r.name for r in await reg.list("ta")} & set(names)
        assert seen_a == {"reg-pub", "reg-a"}
        assert {r.name for r in await reg.list()} >= set(names)
        assert await reg.get_visible("reg-b", "ta") is None
        assert (await reg.get_visible("reg-b", "tb")).name == "reg-b"
        await redis.hset(MODELS_HASH, "reg-junk", b"\xc1not msgpack")
        assert "reg-junk" not in {r.name for r in await reg.list()}  # skipped, not fatal
        assert await reg.delete("reg-a") is True
        assert await reg.delete("reg-a") is False
        assert await reg.get("reg-a") is None
    finally:
        await redis.hdel(MODELS_HASH, *names, "reg-junk")
        await redis.aclose()
