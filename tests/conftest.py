import atexit
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

# Compare's Advanced inputs after the cache checkboxes, as the UI starts: extra specs, group, residual, keys,
# values, rotation, sink, key bits, value bits, weights, batch size (see kvplay/ui/compare.py's `inputs`).
COMPARE_ADVANCED = ["", "default", None, "default", "default", "default", 0, "default", "default", "none", 1]


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


@pytest.fixture(scope="module")
def client():
    """gradio_client against the playground launched on loopback (small limits), one per test module."""
    from gradio_client import Client

    from kvplay.app.settings import Settings
    from kvplay.ui.app import build_app

    app = build_app(Settings(max_new_tokens=64, max_batch=4))
    app.launch(server_name="127.0.0.1", server_port=None, prevent_thread_lock=True, quiet=True)
    try:
        yield Client(app.local_url, verbose=False)
    finally:
        app.close()
