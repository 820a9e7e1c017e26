"""The playground, launched for real and called through gradio_client: every endpoint, good and bad input."""
import json

import pytest

from kvplay.settings import Settings

ADVANCED_DEFAULTS = ["", "default", None, "default", "default", "default", 0, "default", "default", "none", 1]




def test_every_model_event_has_an_api_name(client):
    names = set(client.view_api(return_format="dict")["named_endpoints"])
    assert {"/compare", "/memory", "/capacity", "/throughput", "/quality", "/generate"} <= names


def test_compare_returns_cards_plots_table_and_downloads(client):
    out = client.predict("shakespeare-llama", "ROMEO:\n", 16, ["kvplay-int4", "quanto-int4"], *ADVANCED_DEFAULTS,
                         api_name="/compare")
    cards, snippets, table, kl, agree, nbytes, speed, files = out
    assert cards.count("kv-card'") == 3 and "baseline" in cards and "kvplay-int4" in cards
    assert 'cache_implementation="quantized"' in snippets and "build_cache('kvplay-int4', model)" in snippets
    assert [row[0] for row in table["data"]] == ["baseline", "kvplay-int4", "quanto-int4"]
    for fig in (kl, agree, nbytes, speed):
        assert fig["type"] == "plotly" and json.loads(fig["plot"])["data"]
    paths = [f if isinstance(f, str) else f["path"] for f in files]
    assert sorted(p.rsplit(".", 1)[1] for p in paths) == ["csv", "html", "json"]
    data = json.loads(open(next(p for p in paths if p.endswith(".json"))).read())
    assert [c["spec"] for c in data["caches"]] == ["baseline", "kvplay-int4", "quanto-int4"]


def test_advanced_options_reach_the_specs(client):
    adv = ["kvplay-int2:rotation=hadamard", 32, 8, "channel", "token", "default", 4, 8, 2, "none", 1]
    out = client.predict("shakespeare-llama", "ROMEO:\n", 8, ["kvplay-int4"], *adv, api_name="/compare")
    specs = [row[0] for row in out[2]["data"]]
    assert specs == ["baseline", "kvplay-int4:group=32,residual=8,sink=4,kbits=8,vbits=2",
                     "kvplay-int2:rotation=hadamard"]


def test_memory_capacity_throughput_quality_endpoints(client):
    growth, proj, table, files = client.predict("shakespeare-llama", ["kvplay-int4"], 256, 32, "Llama-2-7B",
                                                       "log", api_name="/memory")
    assert len(json.loads(growth["plot"])["data"]) == 2 and json.loads(proj["plot"])["data"]
    assert [r[0] for r in table["data"]] == ["baseline", "kvplay-int4"]
    cap_table, cap_plot = client.predict(["kvplay-int4"], "Llama-2-7B", 24, "float16", 4096, api_name="/capacity")
    base = cap_table["data"][0]
    assert base[0] == "baseline" and base[2] == 524288 and cap_table["data"][1][3] > base[3]
    tb, tc, t_table, _ = client.predict("shakespeare-llama", ["kvplay-int4"], [1, 2], 32, 4, "64", "none",
                                        api_name="/throughput")
    assert [p for p in json.loads(tb["plot"])["data"][0]["x"]] == [1, 2]
    q_table, q_kl, q_heat, _ = client.predict("shakespeare-llama", ["kvplay-int8"], "held-out play (The Tempest)",
                                              "", 128, 16, api_name="/quality")
    assert [r[0] for r in q_table["data"]] == ["baseline", "kvplay-int8"]
    assert json.loads(q_heat["plot"])["data"][0]["type"] == "heatmap"


@pytest.mark.parametrize("api, args, sentence", [
    ("/compare", ["shakespeare-llama", "   ", 8, ["kvplay-int4"], *ADVANCED_DEFAULTS], "Prompt is empty"),
    ("/compare", ["shakespeare-llama", "ROMEO:", 8, [], "quanto-int8", *ADVANCED_DEFAULTS[1:]],
     "quanto offers int4 and int2"),
    ("/compare", ["shakespeare-llama", "ROMEO:", 8, ["kvplay-int4"], "", 24, *ADVANCED_DEFAULTS[2:]],
     "group size 24 must divide head_dim 64"),
    ("/compare", ["shakespeare-llama", "RO\x00MEO", 8, ["kvplay-int4"], *ADVANCED_DEFAULTS], "control characters"),
    ("/compare", ["nobody-xyz/missing", "ROMEO:", 8, ["kvplay-int4"], *ADVANCED_DEFAULTS], "Hub is unreachable"),
    ("/capacity", [["kvplay-int4"], "Llama-2-7B", 0, "float16", 4096], "GPU memory must be a positive number"),
    ("/capacity", [["kvplay-int4"], "Llama-9-400B", 24, "float16", 4096], "Llama-2-7B"),
    ("/quality", ["shakespeare-llama", ["kvplay-int4"], "pasted text", "Too short.", 128, 16],
     "too short to evaluate"),
    ("/generate", ["shakespeare-llama", "", 8], "Prompt is empty"),
])
def test_bad_input_gets_one_sentence_and_the_app_keeps_serving(client, api, args, sentence):
    with pytest.raises(Exception, match=sentence):
        client.predict(*args, api_name=api)
    assert client.predict("shakespeare-llama", "ROMEO:\n", 3, api_name="/generate").startswith("ROMEO:")


def test_projection_needs_a_sweep_first():
    from kvplay.errors import KvplayError
    from kvplay.ui import make_handlers

    with pytest.raises(KvplayError, match="Run the memory sweep first"):
        make_handlers(Settings())["projection"](None, "Llama-2-7B", "log")


def test_torch_threads_setting_is_applied_and_checked(monkeypatch):
    import dataclasses

    import torch

    from kvplay import service
    from kvplay.errors import KvplayError
    from kvplay.settings import Settings

    monkeypatch.setenv("KVPLAY_TORCH_THREADS", "1")
    settings = Settings.from_env()
    assert settings.torch_threads == 1
    before = torch.get_num_threads()
    try:
        service.apply_settings(settings)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(KvplayError, match="KVPLAY_TORCH_THREADS"):
        service.apply_settings(dataclasses.replace(settings, torch_threads=-2))
