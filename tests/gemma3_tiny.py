"""A Gemma 3 in miniature for the cache tests (no download): the real 270M model's shape of attention, small.

Gemma 3 270M: 18 layers, five sliding-window layers (window 512) per global layer, head_dim 256, one KV head
for 4 query heads, QK-norm. Here: 6 layers (layers 0-4 slide over a 32-token window, layer 5 is global), the
same head_dim, heads and QK-norm, hidden size 64, randomly initialised in bfloat16.
"""
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

WINDOW = 32


def tiny_gemma3(attn_implementation: str = "sdpa", seed: int = 0):
    torch.manual_seed(seed)
    config = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=WINDOW,
                              max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    config._attn_implementation = attn_implementation
    return Gemma3ForCausalLM(config).to(torch.bfloat16).eval()
