"""An embedding from a prefill's last hidden states (POST /v1/embeddings): pooled over the
prompt's positions as the model was registered ("mean", "last", "cls"), L2-normalised or not.

Pure: a tensor in, the vector out as the wire carries it (float32 little-endian bytes, which is
also what OpenAI's base64 `encoding_format` encodes).
"""

from __future__ import annotations

import torch

from shared.schemas import Embedding


def pool(hidden: torch.Tensor, embedding: Embedding) -> bytes:
    """`hidden`: the final norm's output [positions, hidden size] of one prompt (only its last
    position for "last" pooling)."""
    states = hidden.float()  # a bf16 model's mean and norm in float32
    if embedding.pooling == "mean":
        vector = states.mean(dim=0)
    elif embedding.pooling == "last":
        vector = states[-1]
    elif embedding.pooling == "cls":
        vector = states[0]
    else:
        raise ValueError(f"unknown pooling {embedding.pooling!r}")
    if embedding.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.cpu().numpy().astype("<f4").tobytes()
