"""The bundled model: offline loading, tokenizer, determinism, and clear load errors."""
import json

import pytest
import torch

from kvplay.app.models import BUNDLED_PATH, HELD_OUT_TEXT, check_allowed, default_dtype, load_model
from kvplay.app.settings import Settings
from kvplay.errors import KvplayError


def test_bundled_files_are_complete_and_small():
    names = {p.name for p in BUNDLED_PATH.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "README.md"} <= names
    assert sum(p.stat().st_size for p in BUNDLED_PATH.iterdir()) <= 30 * 2**20
    cfg = json.loads((BUNDLED_PATH / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]          # grouped-query attention
    assert cfg["head_dim"] == 64 and cfg["num_hidden_layers"] >= 4
    assert cfg["max_position_embeddings"] >= 16384
    assert HELD_OUT_TEXT.stat().st_size > 50_000


def test_bundled_model_loads_offline_in_16_bit(bundled):
    model, tok = bundled
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.dtype == torch.bfloat16 and model.device.type == "cpu"
    assert tok.padding_side == "left" and tok.pad_token is not None


def test_load_is_cached():
    first = load_model(device="cpu")     # not the session's `bundled`: other tests' models may have evicted it
    assert load_model(device="cpu") is first
    assert load_model("shakespeare-llama", device="cpu") is first


def test_autotokenizer_loads_from_path_offline_and_round_trips():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(BUNDLED_PATH)
    text = "Mir. O, wonder!\nHow many goodly creatures are there here!  — café"
    assert tok.decode(tok(text)["input_ids"]) == text


def test_greedy_generation_is_deterministic(bundled):
    model, tok = bundled
    ids = tok("ROMEO:\n", return_tensors="pt")
    a = model.generate(**ids, max_new_tokens=24, do_sample=False)
    b = model.generate(**ids, max_new_tokens=24, do_sample=False)
    assert a.shape[1] > ids.input_ids.shape[1]
    assert torch.equal(a, b)


def test_default_dtype_policy():
    assert default_dtype("cpu") == torch.bfloat16
    assert default_dtype("cuda") == torch.float16

    class Cfg:
        dtype = torch.bfloat16
    assert default_dtype("cuda", Cfg()) == torch.bfloat16


@pytest.mark.parametrize("name, sentence", [
    ("nobody-xyz/not-a-model", "the Hub is unreachable (offline)"),
    ("bad id with spaces", "neither a local model folder nor a valid Hub id"),
    ("./no/such/folder", "neither a local model folder nor a valid Hub id"),
])
def test_bad_model_names_get_one_sentence(name, sentence):
    with pytest.raises(KvplayError, match=sentence.replace("(", r"\(").replace(")", r"\)")):
        load_model(name, device="cpu")


def test_folder_without_a_model_is_refused(tmp_path):
    with pytest.raises(KvplayError, match="holds no transformers model"):
        load_model(str(tmp_path), device="cpu")


def test_model_without_a_causal_lm_head_is_refused(tmp_path):
    from transformers import ViTConfig

    vit = ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    vit.save_pretrained(tmp_path)
    with pytest.raises(KvplayError, match="not a causal language model"):
        load_model(str(tmp_path), device="cpu")


def test_hosted_policy_blocks_local_paths_and_enforces_allowlist(tmp_path):
    hosted = Settings(allow_local_paths=False, allowed_models=("Qwen/Qwen2.5-0.5B",))
    with pytest.raises(KvplayError, match="local paths is disabled"):
        check_allowed(str(tmp_path), hosted)
    with pytest.raises(KvplayError, match="not allowed here"):
        check_allowed("gpt2", hosted)
    check_allowed("Qwen/Qwen2.5-0.5B", hosted)
    check_allowed(None, hosted)  # the bundled model is always allowed
