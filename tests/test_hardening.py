"""Bad input gets one exact sentence (service layer, CLI and the launched app), and hosted-mode safety holds."""
import ast
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import COMPARE_ADVANCED
from hypothesis import HealthCheck, given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from kvplay.app import (
    capacity,
    catalogue,
    checks,
    compare,
    generate,
    guard,
    memory,
    models,
    prompts,
    quality,
    throughput,
)
from kvplay.app.settings import Settings
from kvplay.cache import SCHEMES
from kvplay.cache.arch import published_archs
from kvplay.errors import KvplayError

S = Settings()                                         # the shipped limits
SMALL = Settings(max_new_tokens=64, max_context=64, max_batch=4, max_specs=2)
GIB = 2**30
KVPLAY = "kvplay-int4"


def bundled_tok():
    return models.load_model(device="cpu")[1]


def n_tokens(text: str) -> int:
    return len(bundled_tok()(text).input_ids)


def offers(family: str) -> str:
    """What the parser says a family offers: its schemes' names after 'family-', the last joined by 'and'."""
    names = [s.name.removeprefix(f"{family}-") for s in SCHEMES.values() if s.name.startswith(f"{family}-")]
    return ", ".join(names[:-1]) + " and " + names[-1]


def local_config(tmp_path, config) -> str:
    config.save_pretrained(tmp_path)
    return str(tmp_path)


def vit_folder(tmp_path):
    from transformers import ViTConfig

    return local_config(tmp_path, ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                            intermediate_size=32))


def llama_70b_folder(tmp_path):
    from transformers import LlamaConfig

    return local_config(tmp_path, LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                              num_attention_heads=64, num_key_value_heads=8, vocab_size=128256))


def free(gib):
    """Patch the one source of free memory: a machine with `gib` GiB free."""
    return lambda device: int(gib * GIB)


def run_bytes(tokens, batch):
    """The run estimate, recomputed here from the bundled config: 16-bit K and V of every layer, plus activations."""
    c = models.load_model(device="cpu")[0].config
    cache = 2 * c.num_hidden_layers * batch * c.num_key_value_heads * tokens * c.head_dim * 2
    return cache + batch * tokens * (c.hidden_size + c.vocab_size) * 4


def gib(n):
    return guard._gib(n)


PROMPT = "ROMEO:\n"
LONG = prompts.default_prompt(models.BUNDLED_NAME)    # the bundled model's prompt: 579 tokens of the play
# Bad specs checked at every entry point (app, CLI, UI): each (spec, its sentence) written once.
BAD_BITS = ("kvplay-int4:kbits=5", "Option kbits=5 in 'kvplay-int4:kbits=5' is invalid; choose 2, 3, 4 or 8.")
BAD_ROTATION = ("kvplay-int4:rotation=givens",
                "Option rotation=givens in 'kvplay-int4:rotation=givens' is invalid; choose none, hadamard or "
                "calibrated.")

# (id, call, the exact sentence). Each call is what the UI and the CLI call.
CASES = [
    ("empty prompt", lambda: generate.generate_text(None, "", 8, settings=S),
     "Prompt is empty; type some text."),
    ("whitespace prompt", lambda: compare.compare(None, [KVPLAY], " \n\t ", 8, settings=S),
     "Prompt is empty; type some text."),
    ("prompt not text", lambda: compare.compare(None, [KVPLAY], 42, 8, settings=S),
     "Prompt must be text, not int."),
    ("NUL in prompt", lambda: compare.compare(None, [KVPLAY], "RO\x00MEO", 8, settings=S),
     r"Prompt contains control characters (such as '\x00'); remove them."),
    ("escape sequence in prompt", lambda: generate.generate_text(None, "\x1b[31mROMEO", 8, settings=S),
     r"Prompt contains control characters (such as '\x1b'); remove them."),
    ("lone surrogate in prompt", lambda: generate.generate_text(None, "RO\ud800MEO", 8, settings=S),
     r"Prompt contains invalid characters (such as '\ud800'); remove them."),
    ("prompt over the configured limit", lambda: compare.compare(None, [KVPLAY], LONG, 8, settings=SMALL),
     lambda: f"The prompt ({n_tokens(LONG)} tokens) plus 8 new tokens exceeds the limit of 64 tokens."),
    ("prompt over the model's context", lambda: generate.generate_text(None, LONG * 60, 8,
                                                                       settings=Settings(max_context=10**6)),
     lambda: f"The prompt ({n_tokens(LONG * 60)} tokens) plus 8 new tokens exceeds the limit of 16384 tokens."),
    ("prompt of a million characters", lambda: generate.generate_text(None, "a" * 10**6, 8, settings=SMALL),
     "The prompt (1000000 characters) is far longer than the limit of 64 tokens."),
    ("zero new tokens", lambda: compare.compare(None, [KVPLAY], PROMPT, 0, settings=S),
     "Max new tokens must be between 1 and 128, got 0."),
    ("negative new tokens", lambda: generate.generate_text(None, PROMPT, -5, settings=S),
     "Max new tokens must be between 1 and 128, got -5."),
    ("fractional new tokens", lambda: compare.compare(None, [KVPLAY], PROMPT, 2.5, settings=S),
     "Max new tokens must be a whole number, not 2.5."),
    ("new tokens as a word", lambda: compare.compare(None, [KVPLAY], PROMPT, "ten", settings=S),
     "Max new tokens must be a whole number, not 'ten'."),
    ("new tokens over the limit", lambda: compare.compare(None, [KVPLAY], PROMPT, 65, settings=SMALL),
     "Max new tokens must be between 1 and 64, got 65."),
    ("new tokens missing", lambda: generate.generate_text(None, PROMPT, None, settings=S),
     "Max new tokens must be a whole number between 1 and 128."),
    ("unknown spec", lambda: compare.compare(None, ["kvplay-int5"], PROMPT, 8, settings=S),
     lambda: f"Unknown cache 'kvplay-int5': kvplay offers {offers('kvplay')}."),
    ("misspelt spec", lambda: memory.memory(None, ["kivi"], 256, settings=S),
     lambda: f"Unknown cache 'kivi'; valid names are {', '.join(SCHEMES)}."),         # the registry's, in order
    ("malformed spec", lambda: compare.compare(None, ["kvplay-int4:group"], PROMPT, 8, settings=S),
     "Option 'group' in 'kvplay-int4:group' must look like key=value."),
    ("spec that is not text", lambda: compare.compare(None, [4], PROMPT, 8, settings=S),
     "A cache spec must be a non-empty string such as 'kvplay-int4'."),
    ("group not dividing head_dim", lambda: compare.compare(None, ["kvplay-int4:group=24"], PROMPT, 8, settings=S),
     "kvplay-int4:group=24: group size 24 must divide head_dim 64 when values are grouped per token."),
    ("negative residual", lambda: compare.compare(None, ["kvplay-int4:residual=-1"], PROMPT, 8, settings=S),
     "Option residual=-1 in 'kvplay-int4:residual=-1' is out of range; it must be between 0 and 65536."),
    ("bits kvplay does not offer", lambda: compare.compare(None, [BAD_BITS[0]], PROMPT, 8, settings=S), BAD_BITS[1]),
    ("bits quanto does not offer", lambda: throughput.throughput(None, ["quanto-int8"], [1], 32, 4, settings=S),
     "Unknown cache 'quanto-int8': quanto offers int4 and int2; try hqq-int8 or kvplay-int8."),
    ("unknown rotation", lambda: quality.ppl(None, [BAD_ROTATION[0]], settings=S), BAD_ROTATION[1]),
    ("too many specs", lambda: compare.compare(None, ["kvplay-int4", "kvplay-int2", "hqq-int4"], PROMPT, 8,
                                               settings=SMALL),
     "At most 2 cache specs per run, got 3."),
    ("specs not a list", lambda: capacity.capacity(7, "Llama-2-7B", 24, settings=S),
     "Cache specs must be a list of spec strings, not int."),
    ("batch size zero", lambda: compare.compare(None, [KVPLAY], PROMPT, 8, batch_size=0, settings=S),
     "Batch size must be between 1 and 8, got 0."),
    ("batch size over the limit", lambda: throughput.throughput(None, [KVPLAY], [1, 5], 32, 4, settings=SMALL),
     "Batch size must be between 1 and 4, got 5."),
    ("no batch size", lambda: throughput.throughput(None, [KVPLAY], [], 32, 4, settings=S),
     "Give at least one batch size."),
    ("temperature out of range", lambda: compare.compare(None, [KVPLAY], PROMPT, 8, temperature=-1, settings=S),
     "Temperature must be a number between 0 and 5."),
    ("seed as a word", lambda: compare.compare(None, [KVPLAY], PROMPT, 8, seed="lucky", settings=S),
     "Seed must be a whole number, not 'lucky'."),
    ("unknown weight format", lambda: compare.compare(None, [KVPLAY], PROMPT, 8, weights="int3", settings=S),
     "Unknown weight format 'int3'; choose int8 or int4."),
    ("unknown dtype", lambda: compare.compare(None, [KVPLAY], PROMPT, 8, dtype="float8", settings=S),
     "Unknown dtype 'float8'; choose one of bf16, bfloat16, float16, float32, fp16, fp32."),
    ("unknown device", lambda: memory.memory(None, [KVPLAY], 256, device="gpu", settings=S),
     "Unknown device 'gpu'; use cuda, mps or cpu."),
    ("memory context too small", lambda: memory.memory(None, [KVPLAY], 10, settings=S),
     "Max context must be between 64 and 16384, got 10."),
    ("throughput context over the limit", lambda: throughput.throughput(None, [KVPLAY], [1], 64, 4, settings=SMALL),
     "Context must be between 1 and 60, got 64."),
    ("ppl chunk zero", lambda: quality.ppl(None, [KVPLAY], chunk=0, settings=S),
     "Chunk must be between 1 and 512, got 0."),
    ("perplexity text too short", lambda: quality.ppl(None, [KVPLAY], text="Too short.", max_tokens=128, settings=S),
     lambda: f"The text is too short to evaluate: {n_tokens('Too short.')} tokens, need at least 64."),
    ("perplexity text with NUL", lambda: quality.ppl(None, [KVPLAY], text="a\x00b", settings=S),
     r"The text contains control characters (such as '\x00'); remove them."),
    ("invalid UTF-8 upload", lambda: checks.decode_text(b"ROMEO \xff\xfe", "upload.txt"),
     "upload.txt is not valid UTF-8 text."),
    ("capacity with 0 GiB", lambda: capacity.capacity([KVPLAY], "Llama-2-7B", 0, settings=S),
     "GPU memory must be a positive number of GiB."),
    ("capacity with negative GiB", lambda: capacity.capacity([KVPLAY], "Llama-2-7B", -24, settings=S),
     "GPU memory must be a positive number of GiB."),
    ("capacity with NaN GiB", lambda: capacity.capacity([KVPLAY], "Llama-2-7B", "nan", settings=S),
     "GPU memory must be a positive number of GiB."),
    ("capacity of an unknown architecture", lambda: capacity.capacity([KVPLAY], "Llama-9-400B", 24, settings=S),
     "Unknown architecture 'Llama-9-400B'; choose one of " + ", ".join(published_archs())
     + "."),
    ("unknown Hub id, offline", lambda: compare.compare("nobody-xyz/missing", [KVPLAY], PROMPT, 8, settings=S),
     "Cannot load 'nobody-xyz/missing': the Hub is unreachable (offline) and the model is not in the local cache."),
    ("malformed model id", lambda: compare.compare("bad id!", [KVPLAY], PROMPT, 8, settings=S),
     "'bad id!' is neither a local model folder nor a valid Hub id like 'org/model' (kvplay's own models: "
     + ", ".join(catalogue.MODELS) + ")."),
    ("model id of 5000 characters", lambda: compare.compare("x" * 5000, [KVPLAY], PROMPT, 8, settings=S),
     "The model name is 5000 characters long; Hub ids and paths here are at most 256."),
    ("model not on the allowlist", lambda: compare.compare("gpt2", [KVPLAY], PROMPT, 8,
                                                         settings=Settings(allowed_models=("Qwen/Qwen2.5-0.5B",))),
     "Model 'gpt2' is not allowed here; allowed: Qwen/Qwen2.5-0.5B."),
]


@pytest.mark.parametrize("call, sentence", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gets_one_exact_sentence(call, sentence):
    with pytest.raises(KvplayError) as err:
        call()
    expected = sentence() if callable(sentence) else sentence
    assert str(err.value) == expected
    assert "\n" not in expected and expected.endswith(".")


# Cases that need a folder on disk or a patched machine.

def test_local_path_refused_when_local_paths_are_off(tmp_path):
    hosted = Settings(allow_local_paths=False)
    with pytest.raises(KvplayError) as err:
        compare.compare(str(tmp_path), [KVPLAY], PROMPT, 8, settings=hosted)
    assert str(err.value) == "Loading models from local paths is disabled on this server; use a Hub id."


def test_local_paths_are_off_on_spaces(monkeypatch):
    monkeypatch.delenv("KVPLAY_ALLOW_LOCAL_PATHS", raising=False)
    monkeypatch.setenv("SPACE_ID", "someone/kvplay")
    assert Settings.from_env().allow_local_paths is False
    monkeypatch.delenv("SPACE_ID")
    assert Settings.from_env().allow_local_paths is True


def test_model_without_a_causal_lm_head(tmp_path):
    path = vit_folder(tmp_path)
    with pytest.raises(KvplayError) as err:
        compare.compare(path, [KVPLAY], PROMPT, 8, settings=Settings(model_cache_size=8))
    assert str(err.value) == f"Model {path!r} (vit) is not a causal language model that transformers can load."


def test_model_too_large_is_refused_from_its_config_before_any_weights_load(tmp_path, monkeypatch):
    path = llama_70b_folder(tmp_path)                        # a config and nothing else: no weights to load
    monkeypatch.setattr(guard, "free_bytes", free(8))
    loads = []
    monkeypatch.setattr(models, "_load", lambda *a: loads.append(a))
    with pytest.raises(KvplayError) as err:
        compare.compare(path, [KVPLAY], PROMPT, 8, settings=Settings(model_cache_size=8))
    # 70.6 billion parameters (Llama-3-70B's shape) x 2 bytes; 8 GiB free less the 10 % reserve
    assert str(err.value) == (f"Model {path!r} in bfloat16 needs about 131.4 GiB but only 7.2 GiB is free; "
                              "choose a smaller model.")
    assert loads == []


def test_weight_estimate_counts_tied_embeddings_once(bundled):
    model, _ = bundled
    assert guard.weight_bytes(model.config, torch.bfloat16) == guard.model_bytes(model)
    assert guard.weight_bytes(model.config, torch.float32) == 2 * guard.model_bytes(model)


def test_run_too_large_for_free_memory_is_refused_before_running(monkeypatch, bundled):
    monkeypatch.setattr(guard, "free_bytes", free(1))         # a 1 GiB machine: 0.5 GiB usable
    steps = []
    monkeypatch.setattr("kvplay.lab.throughput.generate", lambda *a, **k: steps.append(1))
    with pytest.raises(KvplayError) as err:
        throughput.throughput(None, [KVPLAY], [1, 8], 8192, 32, settings=S)
    need = run_bytes(8192 + 32, 8)
    assert str(err.value) == (f"This run needs about {gib(need)} GiB but only 0.5 GiB is free; "
                              "lower the context, batch size or new tokens.")
    assert steps == []
    with pytest.raises(KvplayError, match="only 0.5 GiB is free"):
        compare.compare(None, [KVPLAY], LONG * 8, 128, batch_size=8, settings=S)
    monkeypatch.setattr(guard, "free_bytes", free(64))
    assert compare.compare(None, [KVPLAY], PROMPT, 2, settings=S).caches[0].spec == "baseline"


def test_free_memory_reads_ram_and_the_container_limit():
    import psutil

    assert 0 < guard.free_bytes("cpu") <= psutil.virtual_memory().available


def test_a_cancelled_run_stops_with_one_sentence(bundled):
    token = guard.CancelToken()
    seen = []

    def progress(fraction, desc):
        seen.append(desc)
        if len(seen) == 5:
            token.cancel()
    with pytest.raises(KvplayError) as err:
        compare.compare(None, [KVPLAY], PROMPT, 64, settings=S, progress=progress, cancel=token)
    assert str(err.value) == "The run was cancelled." and len(seen) == 5
    with pytest.raises(KvplayError, match="^The run was cancelled.$"):
        generate.generate_text(None, PROMPT, 64, settings=S, cancel=token)


def test_a_cancel_stops_one_long_forward_at_the_next_layer(bundled):
    """Progress comes between forwards; a 2,048-token prefill is one forward of 9.4 s on 2 AVX2 cores, so the
    envelope also checks before each decoder layer. A cancel set after the third layer ran stops the run there,
    and the shared model keeps no hook afterwards."""
    from kvplay.app import inside

    model = models.load_model(device="cpu")[0]
    layers = model.model.layers                                      # 4 in the bundled model
    ran = []
    counting = [layer.register_forward_hook(lambda *_: ran.append(1)) for layer in layers]
    token = guard.CancelToken(probe=lambda: len(ran) >= 3)
    try:
        with pytest.raises(KvplayError, match="^The run was cancelled.$"):
            inside.error_maps(None, [KVPLAY], tokens=256, settings=S, cancel=token)
    finally:
        for handle in counting:
            handle.remove()
    assert len(ran) == 3                                            # inside the first prefill, not after it
    assert not any(layer._forward_pre_hooks for layer in layers)


def test_a_first_calibration_is_shown_and_a_cancel_stops_it(bundled, monkeypatch, tmp_path):
    """A cache the model has no fragile ranking for measures one before the run (one forward and one backward
    pass): the progress names it layer by layer rather than sitting at 0%, and Stop stops it there with one
    sentence."""
    from kvplay.cache import fragile
    monkeypatch.setattr(fragile, "_RANKINGS", type(fragile._RANKINGS)())       # nothing measured in this process
    monkeypatch.setattr(fragile, "_FISHERS", type(fragile._FISHERS)())
    monkeypatch.setenv("KVPLAY_RANKING_DIR", str(tmp_path))                        # nor kept on disk
    token, seen = guard.CancelToken(), []

    def progress(fraction, desc):
        seen.append(desc)
        if "layer 2 of" in desc:
            token.cancel()
    with pytest.raises(KvplayError, match="^The run was cancelled.$"):
        compare.compare(None, ["kvplay-int2:fragile=0.5,group=16"], PROMPT, 64, settings=S, progress=progress,
                         cancel=token)
    measuring = [d for d in seen if "measuring which layers' keys and values need more bits (one forward" in d]
    assert "forward, layer 2 of 4" in measuring[-1] and seen[-1] == measuring[-1]         # stopped there


def test_a_run_past_the_time_limit_stops_with_one_sentence(bundled):
    token = guard.CancelToken(max_seconds=0.5, clock=time.monotonic)   # wall time here, so sleeping counts
    steps = []

    def slow(fraction, desc):
        steps.append(desc)
        time.sleep(0.1)
    with pytest.raises(KvplayError) as err:
        compare.compare(None, [KVPLAY], PROMPT, 64, settings=S, progress=slow, cancel=token)
    assert str(err.value) == ("The run passed this server's limit of 0.5 CPU seconds; lower the new tokens, "
                              "context, batch size or number of caches.")
    assert 2 <= len(steps) <= 10                  # of the ~200 steps the run would take (measured 4 and 5)


def test_the_time_limit_counts_cpu_seconds_not_waiting():
    token = guard.CancelToken(max_seconds=0.2)
    token.check()
    time.sleep(0.5)                               # waiting (a busy neighbour, a slow client) is not compute
    token.check()
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:        # compute is
        pass
    with pytest.raises(KvplayError, match="limit of 0.2 CPU seconds"):
        token.check()


# ---------------------------------------------------------------------------- the Hub's failures, synthetically

def _response(status: int):
    import httpx2

    url = "https://huggingface.co/org/model/resolve/main/config.json"
    return httpx2.Response(status, request=httpx2.Request("GET", url))


def test_gated_model_is_explained():
    from huggingface_hub.errors import GatedRepoError

    gated = GatedRepoError("Access to model org/model is restricted.", response=_response(401))
    assert str(models._explain("org/model", gated)) == \
        "Model 'org/model' is gated on the Hub: accept its licence and log in (HF_TOKEN) first."
    try:  # as transformers raises it: an OSError from the hub's error
        raise OSError("You are trying to access a gated repo.") from gated
    except OSError as wrapped:
        assert "is gated on the Hub" in str(models._explain("org/model", wrapped))


def test_no_network_is_explained():
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    expected = "Cannot load 'org/model': the Hub is unreachable (offline) and the model is not in the local cache."
    for exc in (LocalEntryNotFoundError("Cannot find the requested files in the disk cache."),
                OfflineModeIsEnabled("Cannot reach https://huggingface.co: offline mode is enabled."),
                OSError("We couldn't connect to 'https://huggingface.co' to load the files.")):
        assert str(models._explain("org/model", exc)) == expected


def test_unknown_repository_and_remote_code_are_explained():
    from huggingface_hub.errors import RepositoryNotFoundError

    missing = RepositoryNotFoundError("404 Client Error: Repository Not Found", response=_response(404))
    assert str(models._explain("org/none", missing)) == \
        "No model named 'org/none' exists on the Hugging Face Hub (check the spelling)."
    custom = ValueError("The repository org/custom contains custom code which must be executed; "
                        "set the option `trust_remote_code=True`.")
    assert str(models._explain("org/custom", custom)) == \
        "Model 'org/custom' needs custom code (trust_remote_code), which kvplay never runs."


# ---------------------------------------------------------------------------- the CLI

@pytest.mark.parametrize("argv, sentence", [
    (["compare", "--caches", "quanto-int8"],
     "Unknown cache 'quanto-int8': quanto offers int4 and int2; try hqq-int8 or kvplay-int8."),
    (["compare", "--prompt", "  "], "Prompt is empty; type some text."),
    (["compare", "--prompt", "RO\x07MEO"], r"Prompt contains control characters (such as '\x07'); remove them."),
    (["compare", "--prompt", "ROMEO", "--max-new-tokens", "0"],                 # the CLI's local limits
     "Max new tokens must be between 1 and 1000000, got 0."),
    (["compare", "--prompt", "ROMEO", "--batch-size", "0"], "Batch size must be between 1 and 1000000, got 0."),
    (["compare", "--prompt", "ROMEO", "--caches", BAD_ROTATION[0]], BAD_ROTATION[1]),
    (["memory", "--device", "gpu"], "Unknown device 'gpu'; use cuda, mps or cpu."),
    (["capacity", "--gpu-gib", "0"], "GPU memory must be a positive number of GiB."),
    (["capacity", "--arch", "Llama-9"],
     f"Unknown architecture 'Llama-9'; choose one of {', '.join(published_archs())}."),
    (["ppl", "--text", "/no/such/file.txt"], "No text file at '/no/such/file.txt'."),
    (["compare", "--model", "nobody-xyz/none"],
     "Cannot load 'nobody-xyz/none': the Hub is unreachable (offline) and the model is not in the local cache."),
])
def test_cli_bad_input_exits_2_with_one_line(argv, sentence, capsys):
    from kvplay.cli.main import main

    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [f"error: {sentence}"] and "Traceback" not in captured.err


def test_cli_refuses_invalid_utf8_and_local_paths_when_hosted(tmp_path, capsys, monkeypatch):
    from kvplay.cli.main import main

    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ROMEO \xff\xfe nope")
    assert main(["ppl", "--text", str(bad)]) == 2
    assert capsys.readouterr().err.splitlines() == ["error: bad.txt is not valid UTF-8 text."]
    monkeypatch.setenv("KVPLAY_ALLOW_LOCAL_PATHS", "0")
    assert main(["compare", "--model", str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: Loading models from local paths is disabled on this server; use a Hub id."]


# ---------------------------------------------------------------------------- fuzzing

ANYTHING = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(), st.binary(),
                     st.lists(st.one_of(st.text(), st.integers(), st.none()), max_size=5),
                     st.dictionaries(st.text(max_size=3), st.integers(), max_size=3), st.just(object()))


@hyp_settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=ANYTHING, text=st.one_of(st.text(), ANYTHING), specs=st.one_of(
    ANYTHING, st.lists(st.sampled_from(["kvplay-int4", "quanto-int2", "baseline", "hqq-int8:group=", "x:y=z",
                                        "kvplay-int2:sink=-1", ":", "kvplay-fp8:kbits=4"]), max_size=20)))
def test_validation_raises_nothing_but_kvplay_error(value, text, specs):
    for call in (lambda: checks.check_int(value, "N", -5, 5), lambda: checks.check_float(value, "T", 0, 5),
                 lambda: checks.clean_text(text), lambda: checks.parse_specs(specs, S),
                 lambda: checks.parse_specs(text, S), lambda: models.resolve_name(text) if text is None or
                 isinstance(text, str) else models.check_allowed(text, S)):
        try:
            call()
        except KvplayError as exc:
            assert str(exc) and "\n" not in str(exc)


# ---------------------------------------------------------------------------- loading and hosted-mode safety

def test_two_threads_asking_for_the_same_model_load_it_once(monkeypatch):
    calls = []

    def slow_load(source, device, dtype):
        calls.append(source)
        time.sleep(0.3)
        return torch.nn.Module(), object()          # a model (load_model packs what it can) and a tokenizer
    monkeypatch.setattr(models, "_load", slow_load)
    monkeypatch.setattr(models, "key_outliers", lambda model, tok: None)     # no transformers model to measure
    roomy = Settings(model_cache_size=8)                 # evict nothing the session's other tests hold
    barrier, results = threading.Barrier(8), []

    def ask():
        barrier.wait()
        results.append(models.load_model(device="cpu", dtype="float32", settings=roomy))
    threads = [threading.Thread(target=ask) for _ in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert len(calls) == 1 and len(results) == 8 and all(r is results[0] for r in results)
    finally:
        with models._cache_lock:
            models._cache.pop((str(models.BUNDLED_PATH), "cpu", torch.float32, roomy.pack_weights), None)


def _hf_loads(tree):
    """Every X.from_pretrained(...) call, and AutoX.from_config(...) (Arch.from_config is kvplay's own)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = getattr(node.func.value, "id", "")
            if node.func.attr == "from_pretrained" or (node.func.attr == "from_config" and owner.startswith("Auto")):
                yield node


def test_remote_code_is_never_trusted():
    import kvplay

    package = Path(kvplay.__file__).parent       # the whole package, every layer (not only kvplay/app)
    checked = 0
    for path in package.rglob("*.py"):
        source = path.read_text(encoding="utf-8")
        assert "trust_remote_code=True" not in source.replace(" ", ""), path
        for call in _hf_loads(ast.parse(source)):
            kw = {k.arg: k.value for k in call.keywords}
            assert "trust_remote_code" in kw and isinstance(kw["trust_remote_code"], ast.Constant) \
                and kw["trust_remote_code"].value is False, f"{path.name}:{call.lineno}"
            checked += 1
    assert checked >= 4                          # measured 4, all in kvplay/app (guard.py, models.py)


def test_no_event_takes_a_file_or_path_from_the_user():
    import gradio as gr

    from kvplay.ui.app import build_app

    app = build_app(Settings())
    for fn in app.fns.values():
        for block in fn.inputs:
            assert not isinstance(block, (gr.File, gr.UploadButton, gr.FileExplorer)), fn.name


def test_downloads_are_written_under_a_folder_the_app_created():
    import tempfile

    from kvplay.results import CapacityResult
    from kvplay.ui import common as ui

    result = capacity.capacity([KVPLAY], "Llama-2-7B", 24, settings=S)
    assert isinstance(result, CapacityResult)
    paths = [Path(p) for p in ui.downloads(result, "capacity")]
    root = ui._download_root[0]
    assert root.name.startswith("kvplay-downloads-") and root.parent == Path(tempfile.gettempdir())
    assert all(p.parent.parent == root and p.is_file() for p in paths)
    stale = root / "run-stale"
    stale.mkdir()
    old = time.time() - ui.DOWNLOAD_TTL_S - 60
    import os

    os.utime(stale, (old, old))
    ui.download_folder()                           # making a new folder removes folders past their time
    assert not stale.exists() and paths[0].exists()


def test_model_handlers_run_one_at_a_time_per_device():
    from kvplay.ui.app import build_app

    app = build_app(Settings(queue_size=5))
    assert app._queue.max_size == 5
    heavy = {fn.api_name: fn for fn in app.fns.values()
             if fn.api_name in ("compare", "memory", "throughput", "quality", "generate")}
    assert len(heavy) == 5
    assert all(fn.concurrency_id == "model" and fn.concurrency_limit == 1 for fn in heavy.values())


def test_no_module_level_state_holds_results():
    """Results live only in what a handler returns (per session in gr.State); module globals hold none."""
    import kvplay.ui.app as ui
    from kvplay import results

    result_types = tuple(v for v in vars(results).values() if isinstance(v, type) and v.__module__ == results.__name__)
    capacity.capacity([KVPLAY], "Llama-2-7B", 24, settings=S)
    for module in (ui, compare, generate, memory, throughput, quality, capacity, guard, models):
        for name, value in vars(module).items():
            items = value.values() if isinstance(value, dict) else \
                value if isinstance(value, (list, tuple)) else [value]
            assert not any(isinstance(v, result_types) for v in items), f"{module.__name__}.{name}"


# ---------------------------------------------------------------------------- the launched app





@pytest.mark.slow                      # launches the app (the session's playground), asked through gradio_client
@pytest.mark.parametrize("api, args, sentence", [
    ("/generate", ["shakespeare-llama", "RO\x1bMEO", 8], r"Prompt contains control characters (such as '\x1b')"),
    ("/generate", ["shakespeare-llama", "ROMEO", 33], "Value 33 is greater than maximum value 32."),  # the slider's own
    ("/generate", ["shakespeare-llama", "ROMEO", 2.5], "Max new tokens must be a whole number, not 2.5."),
    ("/compare", ["shakespeare-llama", "ROMEO", 8, [KVPLAY], "", "4,rotation=hadamard", *COMPARE_ADVANCED[2:]],
     "Option group='4,rotation=hadamard' is invalid; give a number or a single word."),
    ("/compare", ["shakespeare-llama", "ROMEO", 8, [], BAD_BITS[0], *COMPARE_ADVANCED[1:]], BAD_BITS[1]),
    ("/memory", ["shakespeare-llama", [KVPLAY], 256, 32, "Llama-2-7B", "log"], "only 0.5 GiB is free"),
    ("/capacity", [[KVPLAY], "Llama-2-7B", -1, "float16", 4096], "GPU memory must be a positive number of GiB."),
])
def test_app_answers_bad_input_with_the_sentence_and_keeps_serving(client, api, args, sentence, monkeypatch):
    if sentence.startswith("only"):
        monkeypatch.setattr(guard, "free_bytes", free(1))
        monkeypatch.setattr(guard, "run_bytes", lambda *a, **k: GIB)
    with pytest.raises(Exception) as err:
        client.predict(*args, api_name=api)
    assert sentence in str(err.value) and "Traceback" not in str(err.value)
    monkeypatch.undo()
    assert client.predict("shakespeare-llama", "ROMEO:\n", 3, api_name="/generate").startswith("ROMEO:")
