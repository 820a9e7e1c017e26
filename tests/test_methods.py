"""Every registered cache method through the same checks, the registry's options and docs, and the
CONTRIBUTING.md example method added from its one file.

One tiny random Llama (2 layers, 1 KV head, head_dim 64, so every default group divides it) serves
the module; each scheme costs a few tens of milliseconds.
"""
import contextlib
import importlib
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama
from test_bytes import capped, check_bytes

from kvplay.cache import (
    METHODS,
    SCHEMES,
    CacheSpec,
    analytic_nbytes,
    build_cache,
    cache_nbytes,
    cache_schemes,
    dequantized_kv,
    parse_spec,
    scheme_table,
    unregister,
)
from kvplay.cache.arch import Arch
from kvplay.cache.scheme_table import blocks_in, refresh
from kvplay.errors import KvplayError
from kvplay.lab.generate import generate, prefill
from kvplay.lab.metrics import relative_error

ROOT = Path(__file__).resolve().parent.parent
PROMPT, NEW, VOCAB = 150, 12, 96

# Relative Frobenius error of the stored keys and values after one 150-token prefill on this model (worst
# layer, worst of K and V), by nominal bits, measured 2026-12-03 (the capped specs below, seeded model and prompt):
#   8 bits: kvplay-int8 0.0036, hqq-int8 0.0071, kvplay-fp8 0.0225     4 bits: kvplay 0.057, hqq 0.088, quanto 0.092
#           llamacpp-q8_0 0.0074, hf-fp8 0.0272, vllm-fp8 0.0285       llamacpp-q4_1 0.083, iq4_nl 0.084, q4_0 0.092
#   5 bits: llamacpp-q5_1 0.041, llamacpp-q5_0 0.046                   2 bits: kvplay-2.5bit 0.217, kvplay-int2 0.307,
#   3 bits: kvplay-int3 0.135, kvplay-3bit 0.217 (no fragile layers             hqq 0.437, quanto 0.456
#           here)
# Each bound is 3x the worst scheme at those bits, except 2 bits: 2x (0.91), since an all-zero read-back scores 1.0
# (ZERO_READ_BACK) and a bound above it could not fail; the inputs are seeded, so the figures move little.
MAX_ERROR = {8: 0.086, 5: 0.14, 4: 0.28, 3: 0.65, 2: 0.91}
ZERO_READ_BACK = 1.0         # relative_error(zeros, x) for any nonzero x


@pytest.fixture(scope="module")
def model():
    return tiny_llama(head_dim=64)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def exact_kv(model, ids):
    cache = build_cache("baseline", model)
    prefill(model, ids, torch.ones_like(ids), cache)
    return [(layer.keys, layer.values) for layer in cache.layers]


def check_method(model, ids, exact_kv, spec: CacheSpec) -> None:
    """generate, the dequantized view, the snippet: what every method must pass (its exact bytes, against its
    formula: tests/test_bytes.py)."""
    cache = build_cache(spec, model)
    trace = generate(model, ids, cache, NEW, keep_logits=False)
    assert trace.tokens.shape == (1, NEW)
    assert cache.get_seq_length() == PROMPT + NEW - 1                       # the last token is never fed back
    assert (cache_nbytes(cache).payload > 0) == spec.is_quantized

    stored = build_cache(spec, model)
    prefill(model, ids, torch.ones_like(ids), stored)
    for layer, (keys, values) in zip(stored.layers, exact_kv):
        k, v = dequantized_kv(layer)
        assert k.shape == keys.shape and v.shape == values.shape             # (B, H, T, D)
        worst = max(relative_error(k, keys), relative_error(v, values))
        if spec.is_quantized:
            assert 0 < worst <= MAX_ERROR[spec.scheme.bits] < ZERO_READ_BACK, worst
        else:
            assert worst == 0
    compile(spec.method.snippet(spec, 8), f"<snippet {spec}>", "exec")


@pytest.mark.parametrize("name", cache_schemes())
def test_every_registered_scheme_generates_and_reads_back(model, ids, exact_kv, name):
    # test_bytes.capped: a 32-token window < prompt, so tokens really leave the 16-bit window during prefill and
    # decode (a preset's own smaller window stays), key blocks cut to 64 tokens so that one leaves the 150-token
    # prompt, and no fragile layers: ranking them needs a tokenizer this random model lacks (tests/test_fragile.py
    # counts their bytes).
    check_method(model, ids, exact_kv, parse_spec(capped(name)))


def test_every_method_has_a_scheme_a_description_and_declared_layers():
    for method in METHODS.values():
        assert method.schemes and method.description, method.name
        assert bool(method.layer_types) == method.builds_cache, method.name      # other engines hold no layers
        assert all(SCHEMES[s.name].method is method for s in method.schemes)


@pytest.mark.parametrize("name", list(SCHEMES))
def test_every_option_value_the_registry_offers_parses_and_round_trips(name):
    spec = CacheSpec(name)
    for opt in spec.scheme.options():
        for value in dict.fromkeys(opt.grid + opt.choices):                    # what sweeps and the UI offer
            variant = spec.with_options(**{opt.name: value})
            assert getattr(variant, opt.name) == value
            assert parse_spec(str(variant)) == variant
        if opt.choices:
            bad = "nonsense" if opt.kind is str else 12345
            with pytest.raises(KvplayError, match=re.escape(str(opt.choices[-1]))):
                spec.with_options(**{opt.name: bad})


def test_a_cache_layer_no_method_declares_is_an_error_not_16_bit(model, ids):
    from transformers.cache_utils import DynamicLayer

    class Unknown(DynamicLayer):
        pass
    cache = build_cache("baseline", model)
    cache.layers[1] = Unknown()
    prefill(model, ids[:, :8], torch.ones(1, 8, dtype=torch.long), cache)
    with pytest.raises(KvplayError, match="does not know the Unknown cache layer"):
        cache_nbytes(cache)


@pytest.mark.parametrize("doc, block", [("README.md", "scheme list"), ("kvplay/ui/about.md", "scheme table"),
                                        ("docs/options.md", "scheme table")])
def test_the_docs_carry_the_blocks_the_registry_renders(doc, block):
    assert block in blocks_in((ROOT / doc).read_text(encoding="utf-8")), f"{doc} lost its {block} markers"


def test_no_generated_block_is_stale():
    """Every document's generated blocks are what the registry renders now; a stale one names the command."""
    run = subprocess.run([sys.executable, "scripts/docs_tables.py", "--check"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_a_stale_block_is_found_and_rewritten():
    block = ("<!-- generated: scheme list (python scripts/docs_tables.py) -->\n- old\n"
             "<!-- end generated: scheme list -->")
    fresh = refresh("before\n" + block + "\nafter")
    assert fresh.startswith("before\n<!-- generated: scheme list") and fresh.endswith("-->\nafter")
    assert "`kvplay-int4`" in fresh and "- old" not in fresh and refresh(fresh) == fresh
    with pytest.raises(KvplayError, match="Unknown generated block 'nonsense'"):
        refresh(block.replace("scheme list", "nonsense"))


def test_every_module_of_the_methods_folder_is_found_and_the_registry_follows_order():
    """Built-ins are discovered, not listed: each module of kvplay/cache/methods/ that defines a method is
    registered, and the registry (the UI's and the docs' order) goes by each method's `order`."""
    import pkgutil

    import kvplay.cache.methods as package
    from kvplay.cache.methods.base import CacheMethod

    defined = {obj.name for info in pkgutil.iter_modules(package.__path__)
               for obj in vars(importlib.import_module(f"{package.__name__}.{info.name}")).values()
               if isinstance(obj, CacheMethod)}
    assert defined and defined <= set(METHODS)
    builtin = [m for m in METHODS.values() if m.name in defined]
    assert [m.order for m in builtin] == sorted(m.order for m in builtin)
    assert [s.method.name for s in SCHEMES.values()] == sorted((s.method.name for s in SCHEMES.values()),
                                                                key=list(METHODS).index)


# ---------------------------------------------------------------------------- the CONTRIBUTING.md example

def contributing_example() -> str:
    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    return re.search(r"<!-- example method[^>]*-->\n```python\n(.*?)```", text, re.S).group(1)


@contextlib.contextmanager
def contributing_method():
    """The example method, loaded from CONTRIBUTING.md into a temporary module and registered; removed after."""
    module = types.ModuleType("kvplay_contributing_example")
    sys.modules[module.__name__] = module
    try:
        exec(compile(contributing_example(), "CONTRIBUTING.md", "exec"), module.__dict__)
        yield module
    finally:
        if "token-int8" in METHODS:
            unregister("token-int8")
        del sys.modules[module.__name__]


@pytest.fixture
def token_int8():
    with contributing_method() as module:
        yield module


def test_the_contributing_example_is_one_file_that_runs_everywhere(token_int8, model, ids, exact_kv):
    import gradio as gr

    from kvplay.ui.common import presets_box

    assert "token-int8" in SCHEMES and str(parse_spec("token-int8:scale=float32")) == "token-int8:scale=float32"
    for name in ("token-int8", "token-int8:scale=float32"):
        check_method(model, ids, exact_kv, parse_spec(name))
        check_bytes(model, None, name)          # the byte matrix's cell: registered only here, so not in its list
    # 16-bit scales: 64 payload bytes + 2 per row, against 128 for a 16-bit row
    arch = Arch.from_config(model.config)
    assert analytic_nbytes("token-int8", arch, 100).total * 128 == analytic_nbytes("baseline", arch, 100).total * 66
    with gr.Blocks():                           # the checkbox list every tab builds, read from the registry
        box = presets_box()
    assert "token-int8" in [choice[0] for choice in box.choices]
    assert "token-int8" in scheme_table()


def test_the_example_is_gone_after_its_test(model, ids):
    """Registered, the example builds and parses; once its test ends, nothing of it is left in the registry."""
    before = (dict(METHODS), dict(SCHEMES))
    with contributing_method():
        assert "token-int8" in SCHEMES and METHODS["token-int8"].schemes[0].name == "token-int8"
        cache = build_cache("token-int8", model)
        prefill(model, ids[:, :8], torch.ones(1, 8, dtype=torch.long), cache)
        assert cache_nbytes(cache).payload > 0
    assert (dict(METHODS), dict(SCHEMES)) == before
    with pytest.raises(KvplayError, match="Unknown cache 'token-int8'"):
        parse_spec("token-int8")
    with pytest.raises(KvplayError, match="does not know the TokenInt8Layer cache layer"):   # its layers too
        cache_nbytes(cache)


# ---------------------------------------------------------------------------- input checked once

def test_each_spec_is_parsed_once_and_checked_once_per_run(bundled, monkeypatch):
    """The service parses the strings, the runner checks each spec against the model once, build_cache does neither.
    Every module's own name for parse_spec is counted (each `from kvplay.cache import parse_spec` binds one)."""
    from kvplay.app import compare
    from kvplay.app.models import BUNDLED_NAME
    from kvplay.app.settings import Settings
    from kvplay.cache import spec as spec_module
    from kvplay.cache.methods.base import CacheMethod

    parsed, checked = [], []
    parse, check = spec_module.parse_spec, CacheMethod.check_model
    counting = lambda text: (isinstance(text, str) and parsed.append(text), parse(text))[1]  # noqa: E731
    def holders():
        return [m for name, m in list(sys.modules.items())
                if name.split(".")[0] == "kvplay" and getattr(m, "parse_spec", None) is parse]
    found = holders()
    assert len(found) >= 5 and spec_module in found          # 7 here: kvplay.cache, its spec and accounting, ...
    for module in found:
        monkeypatch.setattr(module, "parse_spec", counting)
    monkeypatch.setattr(CacheMethod, "check_model", lambda self, spec, config: (checked.append(str(spec)),
                                                                                check(self, spec, config))[1])
    given = ["kvplay-int4", "quanto-int4:residual=16", "kvplay-int4:group=64"]     # the last is the first again
    result = compare.compare(BUNDLED_NAME, given, "ROMEO:\n", 2, settings=Settings())
    assert holders() == []                                   # nothing imported during the run went uncounted
    assert [c.spec for c in result.caches] == ["baseline", "kvplay-int4", "quanto-int4:residual=16"]
    assert parsed == given
    assert sorted(checked) == ["baseline", "kvplay-int4", "quanto-int4:residual=16"]


@pytest.mark.parametrize("name, attn, path", [("kvplay-int4", "kvplay", "fused from packed codes"),
                                              ("kvplay-int2:attention=sdpa", "sdpa", "dequantize then attend"),
                                              ("baseline:attention=fused", "kvplay", "fused kernel"),
                                              ("baseline:store=prealloc", "sdpa", "preallocated"),
                                              ("kvplay-int2:fragile=0.5", "kvplay", "4-bit keys in layers 0, 1")])
def test_the_snippet_runs_and_reproduces_the_decode_path(name, attn, path):
    """The 'Reproduce in your code' snippet, run on the bundled model's folder: it loads the model with the
    attention implementation the spec's decode path needs, so the user's cache takes the same path."""
    from kvplay.app.catalogue import ASSETS
    from kvplay.results.compare import label_for

    ns = {"MODEL": str(ASSETS / "shakespeare-llama"), "PROMPT": "ROMEO:"}
    snippet = label_for(parse_spec(name), 4).snippet
    exec(compile(snippet, f"<snippet {name}>", "exec"), ns)
    assert ns["model"].config._attn_implementation == attn
    assert ns["out"].shape[1] == ns["inputs"]["input_ids"].shape[1] + 4
    if "cache" in ns:
        assert path in ns["cache"].description


def test_quanto_per_channel_groups_that_do_not_fit_the_prompt_are_one_sentence(bundled):
    """quanto-int2:axis_key=-1 groups channels across tokens: a 50-token prompt does not fill groups of 64, and
    the run stops with kvplay's sentence, not quanto's ValueError (found by the bytes matrix)."""
    model, tok = bundled
    ids = torch.tensor([tok("ROMEO: " * 25).input_ids[:50]])
    cache = build_cache("quanto-int2:axis_key=-1,axis_value=-1", model)
    with pytest.raises(KvplayError, match=r"^quanto with axis -1 .* 50 tokens do not fill whole groups of 64; use"):
        generate(model, ids, cache, 2)
