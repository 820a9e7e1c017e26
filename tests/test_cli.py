"""The command line end to end: every command, its JSON against the documented contract, and its limits.
Bad input, one exact sentence each: tests/test_hardening.py."""
import json
import os
import subprocess
import sys

import pytest
import torch

from kvplay.app import compare, guard, jobs, memory, quality, throughput
from kvplay.app.settings import Settings
from kvplay.cli.main import main
from kvplay.errors import KvplayError
from kvplay.results import MIN_TIMED_STEPS

SPECS = ["kvplay-int4", "quanto-int2"]


def run(tmp_path, *argv):
    out = tmp_path / "out.json"
    assert main([*argv, "--json", str(out), "--csv", str(tmp_path / "out.csv")]) == 0
    assert (tmp_path / "out.csv").read_text().startswith("spec,")
    return json.loads(out.read_text())


def check_caches(data, fields):
    assert [c["spec"] for c in data["caches"]][0] == "baseline"
    for c in data["caches"]:
        assert set(fields) <= set(c), set(fields) - set(c)
    return {c["spec"]: c for c in data["caches"]}


def test_compare_json_contract(tmp_path, capsys):
    data = run(tmp_path, "compare", "--caches", *SPECS, "--prompt", "ROMEO:\n", "--max-new-tokens", "12")
    printed = capsys.readouterr().out.splitlines()        # after the table: the verdict in words, a line per cache
    verdict = printed[printed.index("") + 1:]
    assert [line.split(":")[0].strip() for line in verdict[1:]] == [*SPECS, "16-bit baseline"]
    caches = check_caches(data, ["spec", "text", "first_divergence", "top1_agreement", "mean_kl", "cache_bytes",
                                 "allocated_bytes", "baseline_bytes", "compression", "decode_tokens_per_s"])
    base = caches["baseline"]
    assert base["first_divergence"] is None and base["mean_kl"] == 0 and base["top1_agreement"] == 1
    # A 14-token run: kvplay-int4 still holds it all in its 16-bit window (no saving yet), while quanto-int2
    # quantized the prompt at prefill (measured 1.42x smaller) and drifts for it.
    assert caches["kvplay-int4"]["compression"] == 1.0
    assert caches["quanto-int2"]["compression"] > 1.2 and caches["quanto-int2"]["mean_kl"] > 0
    for c in caches.values():
        assert c["compression"] == c["baseline_bytes"] / c["cache_bytes"]         # measured: exactly
        assert c["allocated_bytes"] >= c["cache_bytes"]
    assert data["env"]["transformers"] and data["env"]["optimum_quanto"] and data["env"]["hqq"]


def test_compare_cache_option_flags_reach_the_specs(tmp_path):
    """`--group 32` sets group on every spec that takes it and does not set it itself (the app's Advanced panel)."""
    data = run(tmp_path, "compare", "--caches", "kvplay-int4", "quanto-int2:group=16", "--group", "32",
               "--prompt", "ROMEO:\n", "--max-new-tokens", "2")
    assert [c["spec"] for c in data["caches"]] == ["baseline", "kvplay-int4:group=32", "quanto-int2:group=16"]
    assert main(["compare", "--caches", "kvplay-int4", "--kbits", "5"]) == 2      # refused as in a spec


def test_memory_json_contract(tmp_path):
    data = run(tmp_path, "memory", "--caches", *SPECS, "--max-context", "256", "--chunk", "64")
    for c in check_caches(data, ["spec", "points"]).values():
        tokens = [p[0] for p in c["points"]]
        assert tokens == [64, 128, 192, 256] and all(b > 0 for _, b in c["points"])
    assert "Llama-2-7B" in data["projections"]


def test_throughput_json_contract(tmp_path):
    data = run(tmp_path, "throughput", "--caches", "kvplay-int4", "--batch-sizes", "1", "2", "--context", "32",
               "--new-tokens", "4", "--contexts", "64")
    for c in check_caches(data, ["spec", "points", "context_points"]).values():
        assert [p[0] for p in c["points"]] == [1, 2] and all(t > 0 for _, t in c["points"])
        assert [p[0] for p in c["context_points"]] == [64]


def test_ppl_json_contract(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(open("assets/texts/tempest.txt", encoding="utf-8").read()[:3000], encoding="utf-8")
    data = run(tmp_path, "ppl", "--caches", *SPECS, "--text", str(text), "--max-tokens", "256")
    caches = check_caches(data, ["spec", "ppl", "delta_ppl_pct", "mean_kl", "top1_agreement"])
    assert caches["baseline"]["delta_ppl_pct"] == 0 and caches["baseline"]["ppl"] > 1


def test_capacity_json_contract(tmp_path):
    data = run(tmp_path, "capacity", "--caches", "kvplay-int4", "--arch", "Llama-2-7B", "--gpu-gib", "24")
    caches = check_caches(data, ["spec", "bits_per_element", "bytes_per_token", "max_context", "max_batch",
                                 "cache_fits"])
    assert caches["baseline"]["bytes_per_token"] == 524288 and data["context_limit"] == 4096
    assert caches["kvplay-int4"]["cache_fits"] > 3 * caches["baseline"]["cache_fits"]
    assert caches["kvplay-int4"]["max_context"] == caches["baseline"]["max_context"] == 4096   # Llama 2's limit


def test_report_is_one_self_contained_html_file(tmp_path):
    a = tmp_path / "a.json"
    assert main(["compare", "--caches", "kvplay-int2", "--prompt", "ROMEO:\n", "--max-new-tokens", "8",
                 "--json", str(a)]) == 0
    b = tmp_path / "b.json"
    assert main(["capacity", "--caches", "kvplay-int2", "--json", str(b)]) == 0
    out = tmp_path / "r.html"
    assert main(["report", "--inputs", str(a), str(b), "--out", str(out)]) == 0
    page = out.read_text()
    assert "<script src=" not in page and len(page) > 1_000_000  # plotly.js is inlined, nothing is fetched
    data = json.loads(page.split('id="kvplay-data">')[1].split("</script>")[0])
    assert [d["kind"] for d in data] == ["compare", "capacity"]
    # Compare's KL, agreement and bytes plots, and its speed when a cache was timed (a busy machine times none:
    # the cards say why); Capacity draws a table only
    timed = any(c["decode_timed_steps"] >= MIN_TIMED_STEPS for c in data[0]["caches"])
    assert page.count("Plotly.newPlot") == 3 + timed and "kvplay-int2" in page


def test_module_entry_point_and_help(capsys):
    """`python -m kvplay` in its own process (12 s on 2 cores, most of it importing torch and transformers), then a
    bad spec through the same main() in this one."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "kvplay", "--help"], capture_output=True, text=True, env=env)
    assert out.returncode == 0
    for command in ("compare", "memory", "throughput", "ppl", "capacity", "report", "bench"):
        assert command in out.stdout
    assert main(["compare", "--caches", "nope"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "valid names are" in err and err.count("\n") == 1


# ---------------------------------------------------------------------------- local limits, one guard

SEVEN = ["quanto-int4", "quanto-int2", "hqq-int4", "kvplay-int8", "kvplay-int4", "kvplay-int2", "kvplay-fp8"]


def test_the_cli_has_local_limits_unless_the_environment_sets_them(tmp_path, monkeypatch, capsys):
    for name in ("KVPLAY_MAX_SPECS", "KVPLAY_MAX_BATCH", "SPACE_ID"):
        monkeypatch.delenv(name, raising=False)
    assert Settings.hosted().max_specs == 6 < len(SEVEN) and Settings.hosted().max_batch == 8
    data = run(tmp_path, "capacity", "--caches", *SEVEN)                  # the app would refuse seven
    assert len(data["caches"]) == 1 + len(SEVEN)
    data = run(tmp_path, "compare", "--caches", "kvplay-int4", "--prompt", "ROMEO:\n", "--max-new-tokens", "1",
               "--batch-size", "9")                                       # and batch 9
    assert len(data["caches"]) == 2

    monkeypatch.setenv("KVPLAY_MAX_SPECS", "6")
    monkeypatch.setenv("KVPLAY_MAX_BATCH", "8")
    capsys.readouterr()
    assert main(["capacity", "--caches", *SEVEN]) == 2
    assert capsys.readouterr().err.strip() == "error: At most 6 cache specs per run, got 7."
    assert main(["compare", "--caches", "kvplay-int4", "--batch-size", "9"]) == 2
    assert "Batch size must be between 1 and 8" in capsys.readouterr().err


def _limits(s: Settings) -> tuple:
    return s.max_new_tokens, s.max_context, s.max_batch, s.max_specs, s.max_seconds


def test_settings_local_and_hosted(monkeypatch):
    for name in ("KVPLAY_MAX_NEW_TOKENS", "KVPLAY_MAX_CONTEXT", "KVPLAY_MAX_BATCH", "KVPLAY_MAX_SPECS",
                 "KVPLAY_MAX_SECONDS", "SPACE_ID"):
        monkeypatch.delenv(name, raising=False)
    assert _limits(Settings.from_env()) == _limits(Settings.hosted()) == _limits(Settings())   # the app's limits
    local = Settings.from_env(hosted=False)
    assert _limits(local) == _limits(Settings.local()) and local.max_seconds == 0
    assert min(local.max_new_tokens, local.max_context, local.max_batch, local.max_specs) >= 10**6
    monkeypatch.setenv("KVPLAY_MAX_NEW_TOKENS", "32")
    assert Settings.from_env(hosted=False).max_new_tokens == 32 and Settings.from_env().max_new_tokens == 32


def test_the_cli_applies_kvplay_torch_threads(tmp_path, monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("KVPLAY_TORCH_THREADS", "1")
    try:
        run(tmp_path, "capacity", "--caches", "kvplay-int4")
        assert torch.get_num_threads() == 1                      # and so the compiled kernel's OpenMP
    finally:
        torch.set_num_threads(before)
    monkeypatch.setenv("KVPLAY_TORCH_THREADS", "-1")
    assert main(["capacity"]) == 2


def test_bench_goes_through_the_memory_guard(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(guard, "free_bytes", lambda device: 0)                # a machine with no memory to spare
    out = tmp_path / "bench.md"
    assert main(["bench", "--quick", "--markdown", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "GiB is free" in err[0] and not out.exists()
    assert main(["bench", "--quick", "--dtype", "float13", "--markdown", str(out)]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_quantized_weights_are_made_once_per_model(monkeypatch):
    first = jobs.get_run_model(None, Settings.local(), weights="int8")
    assert first.weights == "int8" and first.model.model.layers[0].mlp.up_proj.weight_qtype.name == "qint8"
    assert not hasattr(first.model, "kvplay_weights")                         # the record says it, not the model
    monkeypatch.setattr(guard, "free_bytes", lambda device: 0)               # a copy now would be refused
    again = jobs.get_run_model(None, Settings.local(), weights="int8")
    assert again.model is first.model and again.weights == "int8"
    with pytest.raises(KvplayError, match="Quantizing the weights"):
        jobs.get_run_model(None, Settings.local(), weights="int4")


def test_every_result_on_quantized_weights_says_so_from_the_runs_record():
    """The weight format travels in the run's LoadedModel (jobs.get_run_model), not on the model object, and reaches
    each view's environment: Compare, Memory, Throughput and Quality."""
    run = dict(weights="int8", settings=Settings.local())
    results = [compare.compare(None, ["kvplay-int4"], "ROMEO:\n", 2, **run),
               memory.memory(None, ["kvplay-int4"], 64, **run),
               throughput.throughput(None, ["kvplay-int4"], [1], 16, 2, **run),
               quality.ppl(None, ["kvplay-int4"], max_tokens=64, **run)]
    assert [r.env.weights for r in results] == ["quanto int8"] * 4
    assert quality.ppl(None, ["kvplay-int4"], max_tokens=64, settings=Settings.local()).env.weights == "16-bit"
