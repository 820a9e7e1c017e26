"""The real llama.cpp backend (kvplay/lab/llamacpp.py): spec grammar, bytes, routing, and runs on SmolLM2's GGUF.

The grammar, byte and missing-package tests always run; the runs skip, with the command that fixes it,
when llama-cpp-python is not installed (pip install -r requirements-llamacpp.txt) or SmolLM2 is not cached.
"""
import sys

import pytest
import torch

from kvplay.app import compare, fetch, quality
from kvplay.cache import parse_spec
from kvplay.cache.methods.llamacpp_real import row_nbytes
from kvplay.errors import KvplayError
from kvplay.lab import llamacpp
from kvplay.lab.llamacpp import GgufShape, kv_nbytes
from kvplay.lab.metrics import kl_per_step
from kvplay.results import CacheRun, CompareResult, Environment, from_dict, to_dict
from kvplay.show.cards import cards_html, snippets_markdown, verdict_html

REAL = "smollm2-135m-instruct"
SMOLLM2 = GgufShape(layers=30, kv_heads=3, head_dim_k=64, head_dim_v=64)
PROMPT = "Name three colours the sea can have, in one sentence."
KL_Q8_0_MAX = 0.015    # measured 0.0041 on PROMPT (16 tokens; q4_0: 0.088)
needs_llama = pytest.mark.skipif(not llamacpp.available(), reason="llama-cpp-python is not installed: "
                                 "pip install -r requirements-llamacpp.txt")


# ---------------------------------------------------------------------------- always

@pytest.mark.parametrize("text, canonical", [
    ("llama.cpp", "llama.cpp:f16"), ("llama.cpp:q4_0", "llama.cpp:q4_0"), (" LLAMA.CPP:Q8_0 ", "llama.cpp:q8_0"),
    ("llama.cpp:ctk=q4_0,ctv=q4_0", "llama.cpp:q4_0"), ("llama.cpp:ctk=q8_0", "llama.cpp:ctk=q8_0,ctv=f16"),
    ("llama.cpp:ctk=q8_0,ctv=q4_0,attn_rot=off", "llama.cpp:ctk=q8_0,ctv=q4_0,attn_rot=off"),
    ("llama.cpp:iq4_nl,attn_rot=auto", "llama.cpp:iq4_nl")])
def test_spec_canonical_and_round_trip(text, canonical):
    spec = parse_spec(text)
    assert str(spec) == canonical and parse_spec(canonical) == spec and spec.method.engine == "llama.cpp"


@pytest.mark.parametrize("text, words", [
    ("llama.cpp:q3_k", "Unknown llama.cpp cache type 'q3_k'"), ("llama.cpp:f32", "Unknown llama.cpp cache type"),
    ("llama.cpp:depth=2", "Unknown option 'depth'"), ("llama.cpp:q4_0,ctk=q8_0", "'ctk' is given twice"),
    ("llama.cpp:attn_rot=maybe", "attn_rot=maybe .* is invalid; choose auto or off"),
    ("llama.cpp:ctk=", "must look like key=value"),
    ("llama.cpp:,", "has a colon but no options")])
def test_bad_spec_is_one_sentence(text, words):
    with pytest.raises(KvplayError, match=words) as err:
        parse_spec(text)
    assert str(err.value).count(". ") == 0 and str(err.value).endswith(".")


def test_the_real_engine_and_the_emulation_are_told_apart_by_their_method_not_their_name():
    specs = [parse_spec(s) for s in ("kvplay-int4", "llama.cpp:q4_0", "llamacpp-q4_0", "llama.cpp:ctk=q4_0,ctv=q4_0")]
    assert [s.method.builds_cache for s in specs] == [True, False, True, False]   # the emulation is a kvplay cache
    assert len(set(specs)) == 3 and specs[1] == specs[3]                          # one canonical spec


@pytest.mark.parametrize("ggml_type, bits", [("f16", 16), ("bf16", 16), ("q8_0", 8.5), ("q4_0", 4.5), ("q4_1", 5.0),
                                             ("q5_0", 5.5), ("q5_1", 6.0), ("iq4_nl", 4.5)])
def test_bytes_are_ggml_type_sizes(ggml_type, bits):
    assert sum(row_nbytes(ggml_type, 64)) * 8 / 64 == bits
    spec = parse_spec(f"llama.cpp:{ggml_type}")
    assert spec.method.bits(spec) == bits
    # SmolLM2: 30 layers x 3 KV heads x (K + V rows of 64), 1,000 cells
    assert kv_nbytes(spec, SMOLLM2, 1000) == 30 * 3 * 2 * 64 * bits / 8 * 1000


def test_mixed_types_add_their_rows():
    assert kv_nbytes(parse_spec("llama.cpp:ctk=q8_0,ctv=q4_0"), SMOLLM2, 10) == 30 * 3 * (34 * 2 + 18 * 2) * 10
    with pytest.raises(KvplayError, match="multiple of 32"):
        row_nbytes("q4_0", 40)


def test_missing_package_is_one_sentence_before_any_model_loads(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)        # import llama_cpp now raises ImportError
    for call in (lambda: quality.ppl("no-such-model-is-loaded", ["llama.cpp:q4_0"]),
                 lambda: compare.compare("no-such-model-is-loaded", ["llama.cpp:q8_0"], "Hello", 4)):
        with pytest.raises(KvplayError, match=r"pip install -r requirements-llamacpp\.txt\.$"):
            call()


def _run(spec: str, kl: list[float], tokens: list[int], base: bool = False) -> CacheRun:
    n = len(tokens)
    return CacheRun(spec=spec, text="x" * n, token_ids=tokens, tokens=["x"] * n, first_divergence=None,
                    match_fraction=1.0, diff_spans=[], kl=kl, top1=[True] * n, baseline_logprob=[-1.0] * n,
                    mean_kl=sum(kl) / n, max_kl=max(kl), top1_agreement=1.0, context_tokens=list(range(4, 4 + n)),
                    cache_bytes_per_step=[100] * n, cache_bytes=100 if base else 28, baseline_bytes=100,
                    compression=1.0 if base else 100 / 28, bits_per_element=16 if base else 4.5, prefill_s=0.1,
                    prefill_tokens_per_s=40.0, decode_tokens_per_s=0.0, wall_s=1.0, top5_ids=[[1]] * n,
                    top5_probs=[[0.5]] * n, top5_tokens=[["x"]] * n)


def test_a_result_with_llama_cpp_rows_renders_and_round_trips():
    result = CompareResult(prompt="p", prompt_tokens=4, max_new_tokens=3, batch_size=1, sampling={},
                           env=Environment(model=REAL, dtype="bfloat16", device="cpu"),
                           caches=[_run("baseline", [0.0] * 3, [1, 2, 3], base=True),
                                   _run("llama.cpp:f16", [0.0] * 3, [1, 2, 3]),
                                   _run("llama.cpp:ctk=q8_0,ctv=q4_0,attn_rot=off", [0.01, 0.02, 0.03], [1, 2, 3])])
    html = cards_html(result) + verdict_html(result)
    assert "llama.cpp:ctk=q8_0,ctv=q4_0,attn_rot=off" in html
    code = snippets_markdown(result)
    assert "type_k=llama_cpp.GGML_TYPE_Q8_0" in code and "LLAMA_ATTN_ROT_DISABLE" in code
    assert from_dict(to_dict(result)).caches[2].spec == result.caches[2].spec


# ---------------------------------------------------------------------------- the real engine

@pytest.fixture(scope="module")
def compared():
    """llama.cpp's f16, q8_0 and q4_0 on a short chat prompt of SmolLM2 (24 new tokens), through the commands."""
    return compare.compare(REAL, ["llama.cpp:q8_0", "llama.cpp:q4_0"], PROMPT, 24)


@needs_llama
@pytest.mark.real_model
def test_compare_rows_follow_kvplays_and_q8_0_is_closer_than_q4_0(compared):
    specs = [r.spec for r in compared.caches]
    assert specs == ["baseline", "llama.cpp:f16", "llama.cpp:q8_0", "llama.cpp:q4_0"]
    f16, q8, q4 = compared.caches[1:]
    assert f16.mean_kl == 0.0 and f16.top1_agreement == 1.0       # the reference of the llama.cpp rows
    assert 0 < q8.mean_kl < q4.mean_kl
    assert q8.mean_kl < KL_Q8_0_MAX
    assert len(q4.kl) == len(f16.token_ids) <= 24                 # a chat answer may end sooner
    assert all(r.decode_timed_steps >= 8 and r.decode_tokens_per_s > 0 for r in (f16, q8, q4))


@needs_llama
@pytest.mark.real_model
def test_compare_bytes_are_ggml_sizes_of_the_cells_in_use(compared):
    f16, q8, q4 = compared.caches[1:]
    assert q4.cache_bytes == kv_nbytes(parse_spec("llama.cpp:q4_0"), SMOLLM2, q4.context_tokens[-1])
    assert f16.cache_bytes == 30 * 3 * 2 * 64 * 2 * f16.context_tokens[-1]   # each row's own length
    assert q4.cache_bytes_per_step == [kv_nbytes(parse_spec("llama.cpp:q4_0"), SMOLLM2, n) for n in q4.context_tokens]
    assert q8.compression == pytest.approx(16 / 8.5) and q4.compression == pytest.approx(16 / 4.5)
    assert q4.allocated_bytes >= q4.cache_bytes and q4.allocated_bytes % 256 == 0
    assert "type_k=llama_cpp.GGML_TYPE_Q4_0" in snippets_markdown(compared)
    assert "llama.cpp:q4_0" in cards_html(compared) + verdict_html(compared)


@needs_llama
@pytest.mark.real_model
def test_bytes_match_llama_cpps_own_state_size(real):
    """llama_state_seq_get_size grows by the formula's bytes per cell, plus its per-cell bookkeeping."""
    _, tok = real
    ids = tok("To be, or not to be, that is the question: " * 8, verbose=False).input_ids[:64]
    for spec in (parse_spec("llama.cpp"), parse_spec("llama.cpp:ctk=q8_0,ctv=q4_0")):
        with llamacpp.context(fetch.gguf_path(REAL), spec, 256) as llm:
            llm.reset()
            llm.eval(ids[:32])
            small = llamacpp.state_nbytes(llm)
            llm.eval(ids[32:])
            grown = llamacpp.state_nbytes(llm) - small
        formula = kv_nbytes(spec, SMOLLM2, 32)
        # 12 bytes of bookkeeping per cell (its position, seq-id count and seq id): measured 384 over 32 cells
        assert grown - formula == 12 * 32, (spec, grown, formula)


@needs_llama
@pytest.mark.real_model
def test_f16_against_f16_is_zero_and_ppl_rows_order(real):
    _, tok = real
    from kvplay.app.models import HELD_OUT_TEXT

    ids = tok(HELD_OUT_TEXT.read_text(encoding="utf-8"), verbose=False).input_ids[:256]
    path = fetch.gguf_path(REAL)
    with llamacpp.context(path, parse_spec("llama.cpp"), 256) as a:
        p = torch.from_numpy(llamacpp.eval_logits(a, ids))
    with llamacpp.context(path, parse_spec("llama.cpp"), 256) as b:
        q = torch.from_numpy(llamacpp.eval_logits(b, ids))
    assert float(kl_per_step(p, q).max()) < 1e-6                  # measured 0.0: identical logits
    runs = llamacpp.ppl_runs(fetch.gguf_path(REAL), ids, ["llama.cpp:q8_0", "llama.cpp:q4_0"], chunk=256,
                             score_from=128)
    assert [r.spec for r in runs] == ["llama.cpp:f16", "llama.cpp:q8_0", "llama.cpp:q4_0"]
    assert runs[0].mean_kl == 0.0 and 0 < runs[1].mean_kl < runs[2].mean_kl
    assert runs[1].mean_kl < 0.02 and runs[2].mean_kl > 0.01      # measured 0.0046 (q8_0) and 0.056 (q4_0)
    assert runs[2].delta_ppl_pct > runs[1].delta_ppl_pct > 0       # measured +0.17% and +3.2%


def test_the_verdict_names_the_engine_a_row_reproduces():
    """A row that reproduces another engine's cache is named as its users name it, the spec beside it."""
    import json
    from pathlib import Path

    from kvplay.results import from_dict
    from kvplay.results.compare import label_for
    from kvplay.show.cards import headline

    def who(text):
        return label_for(parse_spec(text)).name

    assert who("llamacpp-q4_0") == "llama.cpp q4_0, emulated (llamacpp-q4_0)"
    assert who("llamacpp-q8_0:ctv=q4_0") == "llama.cpp -ctk q8_0 -ctv q4_0, emulated (llamacpp-q8_0:ctv=q4_0)"
    assert who("llama.cpp:q4_0") == "llama.cpp q4_0, the real engine (llama.cpp:q4_0)"
    assert who("vllm-fp8:scales=head") == "vLLM fp8 (head scales), emulated (vllm-fp8:scales=head)"
    assert who("kvplay-int2") == "kvplay-int2" and who("quanto-int4") == "quanto-int4"
    recorded = (Path(__file__).resolve().parents[1] / "assets" / "recorded" / "smollm2-135m-instruct"
                / "pass-code-in-the-tempest.json")
    data = json.loads(recorded.read_text())["result"]
    data["caches"][1]["spec"] = "llamacpp-q4_0"
    data["caches"][1].pop("label", None)             # a stored result without labels gets them from its specs
    _, lines = headline(from_dict(data))
    assert lines[0][1].startswith("llama.cpp q4_0, emulated (llamacpp-q4_0): ")
