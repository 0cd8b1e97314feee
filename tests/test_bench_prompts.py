"""The request-path benchmarks' prompts (bench/e2e_overhead.py): each starts the demo model's
greedy output with a token that decodes to text, so the client's first chunk is the first token's
(a partial UTF-8 byte would be held back by the gateway and add a decode step to the overhead)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from e2e_overhead import visible_prompts  # noqa: E402
from services.gateway.tokenization import IncrementalDetokenizer, encode_text  # noqa: E402
from shared.modelgen import ensure_demo_model  # noqa: E402


def test_each_prompt_has_its_length_and_a_visible_first_token(tmp_path):
    model_dir = Path(ensure_demo_model(tmp_path))
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = visible_prompts(model_dir, tok, [16, 256])
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for length, prompt in prompts.items():
        ids = encode_text(tok, prompt)
        assert abs(len(ids) - length) <= 2
        with torch.inference_mode():
            first = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        assert IncrementalDetokenizer(tok, ids).push([first]).strip()
