import atexit
import functools
import os
import shutil
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"          # nothing in the tests may download
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("KVPLAY_DEFAULT_MODEL", "shakespeare-llama")   # tests name the real model when they want it
# Fragile-layer rankings measured by the tests stay in this run (the shipped seeds are still read).
os.environ["KVPLAY_RANKING_DIR"] = tempfile.mkdtemp(prefix="kvplay-rankings-")
atexit.register(shutil.rmtree, os.environ["KVPLAY_RANKING_DIR"], ignore_errors=True)

import pytest  # noqa: E402
import torch  # noqa: E402


def compare_data(**given) -> list:
    """Compare's inputs in the API's order, as a raw call sends them (kvplay/app/inputs.py declares them): each
    input's default, or its value in `given`."""
    from kvplay.app.inputs import compare_inputs

    inputs = compare_inputs()
    unknown = set(given) - {i.name for i in inputs}
    assert not unknown, f"Compare has no input {sorted(unknown)}"
    return [given.get(i.name, i.default) for i in inputs]


def _compare_advanced() -> list:
    from kvplay.app.inputs import compare_inputs

    names = [i.name for i in compare_inputs()]
    return compare_data()[names.index("caches") + 1:names.index("chat")]


# Compare's inputs after the cache checkboxes and before chat, at their defaults: extra specs, the first Advanced
# options, weights and batch size (positional gradio_client calls leave the rest to their defaults).
COMPARE_ADVANCED = _compare_advanced()


@pytest.fixture(scope="session")
def bundled():
    """(model, tokenizer) of the bundled model, loaded once for the session (bfloat16 on CPU)."""
    from kvplay.app.models import load_model

    return load_model(device="cpu")


def _real_model_cached() -> bool:
    from kvplay.app.fetch import cached_path

    return cached_path("smollm2-135m-instruct") is not None


def pytest_collection_modifyitems(config, items):
    """Tests marked real_model skip, with the command that fixes it, when the real model is not cached."""
    marked = [item for item in items if item.get_closest_marker("real_model")]
    if marked and not _real_model_cached():
        skip = pytest.mark.skip(reason="SmolLM2-135M-Instruct is not cached: "
                                       "python -m kvplay fetch smollm2-135m-instruct")
        for item in marked:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def real():
    """(model, tokenizer) of SmolLM2-135M-Instruct from the local cache, loaded once (bfloat16 on CPU)."""
    from kvplay.app.models import load_model

    return load_model("smollm2-135m-instruct", device="cpu")


def tiny_llama(**overrides):
    """A randomly initialised Llama small enough for per-test use (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, head_dim=32, max_position_embeddings=2048)
    cfg.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.bfloat16).eval()


@pytest.fixture
def tiny():
    return tiny_llama()


def engine_layer(spec, kv_heads: int, head_dim: int = 64, seed: int = 0):
    """A KVPlayLayer for spec (a CacheSpec) outside any model: under rotation=calibrated, a random orthogonal matrix
    per KV head stands in for a model's fitted key rotations (kvplay/cache/rotations.py)."""
    from kvplay.cache.engine import KVPlayLayer

    if spec.rotation != "calibrated":
        return KVPlayLayer(spec)
    gen = torch.Generator().manual_seed(seed)
    return KVPlayLayer(spec, key_rotation=torch.linalg.qr(torch.randn(kv_heads, head_dim, head_dim, generator=gen))[0])


# ---------------------------------------------------------------------------- tiny models of many architectures
# Randomly initialised 2-layer, hidden-64 models in bfloat16 built from transformers config classes (no download),
# used by tests/test_architectures.py and the byte matrix in tests/test_bytes.py.

TINY_VOCAB = 128
_TOKENS = dict(bos_token_id=0, eos_token_id=1, pad_token_id=2)    # inside the tiny vocabulary
_DECODER = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512, **_TOKENS)
_SLIDING = dict(sliding_window=32, layer_types=["sliding_attention", "full_attention"])


def _tiny_archs():
    import transformers as T

    # name: (config class, model class, config kwargs). Every head_dim is 32.
    full = {
        "llama": (T.LlamaConfig, T.LlamaForCausalLM, dict(_DECODER, head_dim=32)),
        "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(_DECODER, head_dim=32, sliding_window=None)),
        "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, dict(_DECODER)),
        "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, dict(_DECODER, head_dim=32)),
        "phi3": (T.Phi3Config, T.Phi3ForCausalLM, dict(_DECODER)),
        "gemma": (T.GemmaConfig, T.GemmaForCausalLM, dict(_DECODER, head_dim=32)),
        "gpt-neox": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM,
                     dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=2, max_position_embeddings=512, **_TOKENS)),
        "opt": (T.OPTConfig, T.OPTForCausalLM,
                dict(vocab_size=TINY_VOCAB, hidden_size=64, ffn_dim=128, word_embed_proj_dim=64, num_hidden_layers=2,
                     num_attention_heads=2, max_position_embeddings=512, **_TOKENS)),
        "gpt2": (T.GPT2Config, T.GPT2LMHeadModel,
                 dict(vocab_size=TINY_VOCAB, n_embd=64, n_inner=128, n_layer=2, n_head=2, n_positions=512, **_TOKENS)),
    }
    # Sliding-window layers mixed with full-attention layers (window 32 < prompt, so the window really slides).
    mixed = {
        "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, dict(_DECODER, head_dim=32, **_SLIDING)),
        "gemma3-text": (T.Gemma3TextConfig, T.Gemma3ForCausalLM, dict(_DECODER, head_dim=32, **_SLIDING)),
        "qwen2-swa": (T.Qwen2Config, T.Qwen2ForCausalLM,   # layers >= max_window_layers slide
                      dict(_DECODER, use_sliding_window=True, sliding_window=32, max_window_layers=1)),
    }
    # Configs that set sliding_window without layer_types, as published Mistral-7B-v0.1 (4096) and
    # Phi-3-mini-4k (2047) do: transformers' cache then makes every layer a sliding-window layer.
    sliding_only = {
        "mistral-sliding": (T.MistralConfig, T.MistralForCausalLM, dict(_DECODER, head_dim=32, sliding_window=4096)),
        "phi3-sliding": (T.Phi3Config, T.Phi3ForCausalLM, dict(_DECODER, sliding_window=2047)),
    }
    # head_dim 15 (odd, and divisible by no group size): refused where it must be, works where it can.
    odd = {"gpt2-odd-head-dim": (T.GPT2Config, T.GPT2LMHeadModel,
                                 dict(vocab_size=TINY_VOCAB, n_embd=60, n_inner=128, n_layer=2, n_head=4,
                                      n_positions=512, **_TOKENS))}
    return full, mixed, sliding_only, odd


FULL_ATTENTION, MIXED, SLIDING_ONLY, ODD = _tiny_archs()
ARCHS = {**FULL_ATTENTION, **MIXED, **SLIDING_ONLY, **ODD}


@functools.cache
def tiny_arch(arch: str):
    """The tiny random model of ARCHS[arch], built once per session (eval, bfloat16)."""
    config_cls, model_cls, kwargs = ARCHS[arch]
    torch.manual_seed(0)
    return model_cls(config_cls(**kwargs)).to(torch.bfloat16).eval()


# The launched playground's limits: Compare's default is 32 new tokens here, to keep it fast.
CLIENT_SETTINGS = dict(max_new_tokens=32, max_batch=4, default_model="shakespeare-llama")


@pytest.fixture(scope="session")
def playground():
    """gradio_client against the playground launched on loopback with CLIENT_SETTINGS, once per session."""
    from gradio_client import Client

    from kvplay.app.settings import Settings
    from kvplay.ui.app import build_app
    from kvplay.ui.common import warm_start

    settings = Settings(**CLIENT_SETTINGS)
    app = build_app(settings)
    app.launch(server_name="127.0.0.1", server_port=None, prevent_thread_lock=True, quiet=True)
    try:
        yield Client(app.local_url, verbose=False)
    finally:
        app.close()
        warm_start(settings, settings.default_model).join(timeout=300)   # never leave the warm-up running at exit


@pytest.fixture
def client(playground):
    """The session's playground client, with torch on one thread for the test (as KVPLAY_TORCH_THREADS=1: the
    client and the server share 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield playground
    finally:
        torch.set_num_threads(threads)
