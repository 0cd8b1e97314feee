"""A torch model's weights: which decoder layer a checkpoint tensor belongs to, reading only the
tensors wanted (a converted checkpoint's partitions, else the safetensors files), building a model
that holds only some layers, adding or dropping layers, and what a model's weights take. Also what
the torch engine supports and how a model built on the meta device is made whole."""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from services.node.loader.checkpoint_format import default_checkpoint_dir, read_index

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The decoder layer a checkpoint tensor belongs to (None: embeddings, final norm, head)."""
    match = LAYER_NAME.match(name)
    return int(match.group(1)) if match else None


def read_tensors(model_dir: str | Path, wanted: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """The checkpoint tensors whose names `wanted` accepts, reading only their bytes: from the
    converted checkpoint's partitions when there is one (one pread per tensor), else from the
    safetensors files (safetensors reads a tensor's own byte range)."""
    model_dir = Path(model_dir)
    ckpt = default_checkpoint_dir(model_dir)
    index = read_index(ckpt)
    out: dict[str, torch.Tensor] = {}
    if index is not None:
        fds: dict[str, int] = {}
        try:
            for entry in index.tensors:
                if not wanted(entry.name):
                    continue
                fd = fds.get(entry.file)
                if fd is None:
                    fd = fds[entry.file] = os.open(ckpt / entry.file, os.O_RDONLY)
                raw = torch.empty(entry.size, dtype=torch.uint8)
                view = memoryview(raw.numpy())
                got = 0
                while got < entry.size:
                    n = os.preadv(fd, [view[got:]], entry.offset + got)
                    if n <= 0:
                        raise OSError(f"{ckpt / entry.file} ends inside {entry.name}")
                    got += n
                out[entry.name] = raw.view(getattr(torch, entry.dtype)).view(entry.shape)
        finally:
            for fd in fds.values():
                os.close(fd)
        return out
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds neither a converted checkpoint nor safetensors")
    for path in files:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                if wanted(name):
                    out[name] = f.get_tensor(name)
    return out


# Building a model is not thread-safe: transformers' from_pretrained and from_config switch
# process-wide state while they run (module registration patched to put tensors on the meta
# device, the default dtype), so two instances loading at once on one node could leave one with
# meta buffers ("Cannot copy out of meta tensor", in a run of `make test`: two instances of one
# model loading side by side). Builds take turns; reading the checkpoint does not need to.
BUILD_LOCK = threading.Lock()


def partial_model(config, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None,
                  device: torch.device, local: Callable[[str], bool]) -> torch.nn.Module:
    """The model built on the meta device with `tensors` as its parameters (assign: on CPU they
    are the tensors read, no copy); parameters `local` rejects stay on the meta device (no
    memory). ValueError when a parameter `local` accepts is missing."""
    from transformers import AutoModelForCausalLM

    state = dict(tensors)
    dtype = dtype or config_dtype(config, state)
    state = {k: t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device)
             for k, t in state.items()}
    with BUILD_LOCK:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.load_state_dict(state, strict=False, assign=True)
        model.tie_weights()
        rebuild_meta_buffers(model, config, device)
    if missing := [n for n, p in model.named_parameters() if p.is_meta and local(n)]:
        raise ValueError(f"the checkpoint lacks {missing[:5]}")
    return model.eval()


def assign_layers(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor],
                  device: torch.device, dtype: torch.dtype) -> None:
    """Give a partial model the parameters in `tensors` (layers it now holds)."""
    state = {k: t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device)
             for k, t in tensors.items()}
    model.load_state_dict(state, strict=False, assign=True)


def drop_layers(model: torch.nn.Module, layers: range) -> None:
    """Hand back the memory of decoder layers this process no longer runs (meta parameters)."""
    for i in layers:
        model.model.layers[i].to("meta")


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)


def holding_of(index, blocks: list, held: set[int], node: str = ""):
    """What a node receiving a checkpoint by multicast can run now (shared.core.pipeline): the
    layers, and the head, whose every byte lies in the `held` blocks of `index`'s partitions."""
    from shared.core.pipeline import TensorSpan, layers_held

    spans = [TensorSpan(t.name, t.file, t.offset, t.offset + t.size) for t in index.tensors]
    return layers_held(spans, blocks, held, node)


def held_tensors(host, holding) -> dict[str, torch.Tensor]:
    """Views of the tensors of a partly received host checkpoint (`HostCheckpoint`) that the
    node holds whole (`holding_of`): what a head engine (`weights=`) or an in-process stage
    (`LayerStage(tensors=)`) may use; never a tensor with bytes still missing."""
    views = host.tensors(torch.device("cpu"))
    return {n: t for n, t in views.items()
            if ((i := layer_of(n)) is None and holding.head) or i in holding.layers}


def config_dtype(config, state: dict[str, torch.Tensor]) -> torch.dtype:
    """What from_pretrained(dtype="auto") picks: the config's dtype, else the checkpoint's."""
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = DTYPES.get(dtype)
    if isinstance(dtype, torch.dtype):
        return dtype
    return next(t.dtype for t in state.values() if t.is_floating_point())


def rebuild_meta_buffers(model: torch.nn.Module, config, device: torch.device) -> None:
    """Non-persistent buffers (the rotary embedding's inverse frequencies) are not in a
    checkpoint: a model built on the meta device gets its rotary modules built again for real."""
    for name, module in list(model.named_modules()):
        if not any(b.is_meta for b in module.buffers(recurse=False)):
            continue
        if not name.endswith("rotary_emb"):
            raise ValueError(f"{name} has buffers that are neither in the checkpoint nor known")
        parent, _, child = name.rpartition(".")
        with torch.device(device):  # where the module computes its buffers
            rebuilt = type(module)(config)
        setattr(model.get_submodule(parent), child, rebuilt)


def check_supported(config) -> None:
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"torch engine supports {SUPPORTED_MODEL_TYPES}, "
                         f"not model_type {config.model_type!r}")
    window = getattr(config, "sliding_window", None)
    if window is not None and window < config.max_position_embeddings:
        raise ValueError("sliding-window attention is not implemented by the torch engine")
