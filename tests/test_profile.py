"""A model kvplay has not seen gets a card (issue 49): its attention's shape and its key outlier channels, measured
in one 16-bit pass (kvplay/lab/profile.py), said in words (kvplay/show/profile.py), printed by `python -m kvplay
profile` and before Compare's verdict for any model outside the catalogue."""
import json

import torch
from gemma3_tiny import tiny_gemma3

from kvplay.app.models import BUNDLED_PATH
from kvplay.cli.main import main
from kvplay.lab.profile import model_profile
from kvplay.results import from_dict, to_dict
from kvplay.show.cards import verdict_html
from kvplay.show.profile import profile_text


def test_the_profile_finds_a_planted_outlier_channel_and_the_sliding_layers(bundled):
    _, tok = bundled
    model = tiny_gemma3("kvplay")
    model.resize_token_embeddings(len(tok))
    clean = model_profile(model, tok, model_name="tiny", tokens=64)
    assert (clean.layers, clean.full_layers, clean.sliding_layers, clean.sliding_window) == (6, 1, 5, 32)
    assert (clean.query_heads, clean.kv_heads, clean.head_dim) == (4, 1, 256)
    with torch.no_grad():                  # one key channel of layer 3, 200x larger: an outlier there alone
        proj = model.model.layers[3].self_attn.k_proj
        proj.weight[7] *= 200
    planted = model_profile(model, tok, model_name="tiny", tokens=64)
    assert 3 in planted.outlier_layers and 3 not in clean.outlier_layers
    assert planted.key_ratio[3] > 10 * clean.key_ratio[3]
    text = profile_text(planted)
    assert "5 sliding-window layers" in text and "1 KV head " in text and "layer 3" in text
    assert from_dict(to_dict(planted)) == planted


def test_a_brought_folder_gets_its_card_before_the_verdict(capsys, tmp_path):
    """The bundled model's folder, brought by path as a user's own model is: `profile` prints its card, and
    Compare prints the card, then its table and verdict."""
    assert main(["profile", "--model", str(BUNDLED_PATH)]) == 0
    card = capsys.readouterr().out
    assert card.startswith(f"{BUNDLED_PATH}. llama: 4 layers") and "(one 16-bit pass over 256 tokens" in card
    assert main(["compare", "--model", str(BUNDLED_PATH), "--caches", "kvplay-int4", "--max-new-tokens", "4",
                 "--prompt", "ROMEO:", "--json", str(tmp_path / "compare.json")]) == 0
    out = capsys.readouterr().out
    assert out.index("llama: 4 layers") < out.index("kvplay-int4") < out.index("16-bit baseline")
    result = from_dict(json.loads((tmp_path / "compare.json").read_text()))        # the card is in the JSON too
    assert result.profile.layers == 4 and "llama: 4 layers" in verdict_html(result)     # and on the page
    assert main(["compare", "--model", "shakespeare-llama", "--caches", "kvplay-int4", "--max-new-tokens", "2",
                 "--prompt", "ROMEO:"]) == 0
    assert "layers" not in capsys.readouterr().out.split("\n")[0]       # a catalogue model: no card printed
