"""Every figure true in every view (issue 50): one matrix over views × levers × model families.

Each cell runs one view with one lever's cache on a tiny random model of one family, and must give either a true
result or a refusal in one sentence that names the cache, never a traceback and never a figure another view
contradicts. The invariant they share: the bytes a cache holds after a prompt of P tokens are the same in Compare
(after its prefill), Memory (its point at P), tasks (its bits after the prompt) and the byte formula, for every
lever, eviction included. A new view or lever is one more entry in VIEWS or LEVERS, not a new kind of test.

The families are the catalogue's layouts in miniature, each with the bundled tokenizer's vocabulary so the views'
own texts and tasks run: Llama; Qwen2, whose keys carry a bias; Gemma 3, five sliding layers to one global one.
"""
import functools

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from kvplay.cache import analytic_nbytes, bits_per_element, parse_spec
from kvplay.cache.arch import Arch
from kvplay.cache.evict import policy_of
from kvplay.errors import KvplayError
from kvplay.lab.compare import run_compare
from kvplay.lab.memory import memory_sweep, prompt_lengths
from kvplay.lab.quality import perplexity_run
from kvplay.lab.tasks.run import tasks_run
from kvplay.results import from_dict, to_dict
from kvplay.show import plots, report
from kvplay.show.style import colour_for

PROMPT = 128                      # a prompt length every view measures at: a doubling of the memory chunk
CHUNK = 32
SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
             max_position_embeddings=1024, bos_token_id=0, eos_token_id=1, pad_token_id=2)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(num_hidden_layers=2)),
    "qwen2-key-bias": (Qwen2Config, Qwen2ForCausalLM, dict(num_hidden_layers=2)),       # q/k/v projections biased
    "gemma3-sliding": (Gemma3TextConfig, Gemma3ForCausalLM,
                       dict(num_hidden_layers=6, sliding_window=32)),                   # layers 0-4 slide, 5 global
}
LEVERS = {
    "16-bit": "baseline",
    "quantized": "kvplay-int4:residual=16",                     # a 16-token window: the prompt really quantizes
    "evicted": "baseline:evict=snapkv,keep=0.25",
    "both": "kvplay-int4:residual=16,evict=snapkv,keep=0.5",
    "refused on sliding layers": "quanto-int4:group=32",        # transformers' quantized cache: not on Gemma 3
}


@functools.cache
def family(name: str, vocab: int):
    config_cls, model_cls, extra = FAMILIES[name]
    config = config_cls(vocab_size=vocab, **{**SHAPE, **extra})
    config._attn_implementation = "kvplay"                      # as kvplay loads every model (eviction reads queries)
    torch.manual_seed(0)
    return model_cls(config).to(torch.bfloat16).eval()


def prompt_ids(tok) -> list[int]:
    return tok("The quick brown fox jumps over the lazy dog. " * 40).input_ids[:PROMPT]


def formula_bytes(spec: str, model, tokens: int, prefill: int | None = None) -> int:
    return analytic_nbytes(parse_spec(spec), Arch.from_config(model.config), tokens, prefill=prefill or tokens).total


# Each view: (model, tokenizer, spec) -> (its result, (the bytes it shows for `spec` at PROMPT tokens, how many of
# them arrived as the prompt)), (result, None) where it shows no bytes, or a KvplayError; a cache the model refuses
# is named in result.refused.
def compare_view(model, tok, spec):
    res = run_compare(model, tok, [spec], "", 4, prompt_ids=prompt_ids(tok))
    assert from_dict(to_dict(res)).caches[-1].cache_bytes_per_step == res.caches[-1].cache_bytes_per_step
    assert "<html" in report.build_report([res]).lower()                                  # the report draws it
    return res, (res.caches[-1].cache_bytes_per_step[0], PROMPT)                  # after the prefill


def memory_view(model, tok, spec):
    res = memory_sweep(model, tok, [spec], PROMPT, CHUNK)
    series = res.caches[-1]
    for trace in plots.memory_figure(res).data:                     # the same colour as in every other chart
        assert trace.line.color == colour_for(trace.name), trace.name
    assert PROMPT in prompt_lengths(PROMPT, CHUNK)
    # An evicting cache: one prompt of each length. Any other: a first chunk, then chunks that arrive as decode
    # steps do (transformers' QuantizedCache re-quantizes when its residual fills, whatever the step's size).
    prefill = PROMPT if policy_of(parse_spec(spec)) else CHUNK
    return res, (dict(series.points)[PROMPT], prefill)


def tasks_view(model, tok, spec):
    res = tasks_run(model, tok, [spec], [PROMPT * 2], kinds=["niah_single"], samples=1, chat=False)
    tokens = res.prompt_tokens[0]
    bits = res.caches[-1].bits[0]                      # measured after the prompt, rounded to 3 decimals
    arch = Arch.from_config(model.config)
    expected = bits_per_element(formula_bytes(spec, model, tokens), arch, tokens)
    assert bits == pytest.approx(expected, abs=1e-3)
    return res, None


def quality_view(model, tok, spec):
    res = perplexity_run(model, tok, [spec], max_tokens=64, chunk=16)
    assert [c.spec for c in res.caches][-1] == spec and res.caches[-1].ppl > 0
    return res, None


VIEWS = {"compare": compare_view, "memory": memory_view, "tasks": tasks_view, "quality": quality_view}
# The refusals that are true, and only those: transformers' quantized cache on sliding layers, in every view; an
# evicting cache in a view over a fixed text, which would fault it for dropping what the text needs later.
REFUSED = {*((view, "refused on sliding layers", "gemma3-sliding") for view in VIEWS),
           *(("quality", lever, f) for lever in ("evicted", "both") for f in FAMILIES)}


@pytest.mark.parametrize("family_name", FAMILIES)
@pytest.mark.parametrize("lever", LEVERS)
@pytest.mark.parametrize("view", VIEWS)
def test_every_cell_is_a_true_result_or_one_sentence(bundled, view, lever, family_name):
    _, tok = bundled
    model, spec = family(family_name, len(tok)), LEVERS[lever]
    refusal = (view, lever, family_name) in REFUSED
    try:
        res, shown = VIEWS[view](model, tok, spec)
    except KvplayError as e:                                        # a refusal: one sentence naming the cache
        said = str(e)
        assert refusal, said
        assert spec.split(":")[0] in said and "\n" not in said and said.endswith("."), said
        return
    if spec in getattr(res, "refused", {}):                         # refused by the model, the run went on
        said = res.refused[spec]
        assert refusal, said
        assert "\n" not in said and said.endswith(".") and spec in said, said
        assert spec not in [c.spec for c in res.caches]
        return
    assert not refusal and spec in [c.spec for c in res.caches]
    if shown is not None:
        nbytes, prefill = shown
        assert nbytes == formula_bytes(spec, model, PROMPT, prefill), (view, lever, family_name)
