"""Value bits by layer, screened: which layers' 4-bit values cut a preset's KL most (an experiment for issue 27).

    PYTHONPATH=. TOKENS=1024 python scripts/screen_value_layers.py                       # rank the 30 layers
    PYTHONPATH=. TOKENS=2048 LAYERS=18,24,23 python scripts/screen_value_layers.py       # the first k of a ranking
    SPEC=kvplay-3bit TEXT=assets/texts/python-reference.txt ...                          # another preset or text

Each layer's value format is swapped for the same format at 4 bits in the screen (scripts/screen_bits.py), by a
ranking measured here on the text itself. The record of round 3's screen (docs/quality-ablation.md); the engine
now has per-layer value bits of its own, ranked on a calibration text (`vfragile`, kvplay/cache/fragile.py).
Prints (delta ppl %, mean KL, top-1) per configuration.
"""
import os
import sys
from dataclasses import replace
from pathlib import Path

import scripts.screen_bits as S
from kvplay.app.models import load_model
from kvplay.cache import build_cache
from kvplay.cache.fragile import mean_kl
from kvplay.lab.metrics import perplexity, token_logprob
from kvplay.lab.texts import HELD_OUT_TEXT

text = Path(os.environ.get("TEXT", str(HELD_OUT_TEXT)))
spec = os.environ.get("SPEC", "kvplay-3bit")
model, tok = load_model("smollm2-135m-instruct")
ids = tok(text.read_text(), return_tensors="pt", verbose=False).input_ids[:, :int(os.environ.get("TOKENS", "1024"))]
targets = ids[0, 1:]
n_layers = model.config.num_hidden_layers
reference = S.run(model, ids, [None] * n_layers, 16)
base_ppl = perplexity(-token_logprob(reference[:-1], targets))


def score(four_bit_values: list[int]) -> tuple[float, float, float]:
    layers = build_cache(spec, model, tok).layers
    for i in four_bit_values:
        layers[i].value_fmt = replace(layers[i].value_fmt, bits=4)
    logits = S.run(model, ids, layers, 16)
    ppl = perplexity(-token_logprob(logits[:-1], targets))
    return (100 * (ppl / base_ppl - 1), mean_kl(reference[None], logits[None]),
            float((reference.argmax(-1) == logits.argmax(-1)).float().mean()))


base = score([])
print("none", base, flush=True)
if os.environ.get("LAYERS"):
    chosen = [int(x) for x in os.environ["LAYERS"].split(",")]
    for k in range(1, len(chosen) + 1):
        print(chosen[:k], score(chosen[:k]), flush=True)
    sys.exit()
gains = []
for i in range(n_layers):
    s = score([i])
    gains.append((base[1] - s[1], i))
    print(i, s, flush=True)
print("ranking", [i for _, i in sorted(gains, reverse=True)])
