import os

os.environ["HF_HUB_OFFLINE"] = "1"          # nothing in the tests may download
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import pytest  # noqa: E402
import torch  # noqa: E402



@pytest.fixture(scope="session")
def bundled():
    """(model, tokenizer) of the bundled model, loaded once for the session (bfloat16 on CPU)."""
    from kvplay.models import load_model

    return load_model(device="cpu")


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

    from kvplay.settings import Settings
    from kvplay.ui import build_app

    app = build_app(Settings(max_new_tokens=64, max_batch=4))
    app.launch(server_name="127.0.0.1", server_port=None, prevent_thread_lock=True, quiet=True)
    try:
        yield Client(app.local_url, verbose=False)
    finally:
        app.close()
