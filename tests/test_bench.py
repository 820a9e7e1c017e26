"""A smoke run of the benchmark, so it cannot rot: every JSON field is there. Nothing about speed."""
import json

import pytest

from kvplay.cache.arch import Arch
from kvplay.cli.main import main
from kvplay.lab.bench import BENCH_SPECS, FASTEST_16BIT, BenchConfig, run_bench
from kvplay.results.bench_targets import targets
from kvplay.show.bench_page import markdown


@pytest.fixture(scope="module")
def smoke(bundled):
    model, tok = bundled
    return run_bench(model, tok, config=BenchConfig.smoke(), command="pytest smoke")


def test_benchmark_smoke_run_has_every_field(bundled, smoke, tmp_path):
    result = json.loads(json.dumps(smoke))
    result["targets"] = targets(result)
    json.loads(json.dumps(result))                      # serialisable
    for key in ("memory", "limits", "decode_speed", "decode_speed_batch4", "quality", "machine", "command"):
        assert key in result, key
    for spec in BENCH_SPECS:
        assert set(result["memory"][spec]) == {"256"} and result["limits"][spec]["256"] > 0
        assert set(result["decode_speed"][spec]) == {"128"} and result["decode_speed"][spec]["128"] > 0
        assert set(result["decode_speed_batch4"][spec]) == {"128"}
        assert {"delta_ppl_pct", "mean_kl", "top1_agreement"} <= set(result["quality"][spec])
        assert set(result["decode_speed_vs_fastest_16bit"][spec]) == {"128"}
        assert set(result["decode_speed_batch4_vs_fastest_16bit"][spec]) == {"128"}
    # The memory cells hold what was asked: the 16-bit cache at 256 tokens is 2 bytes per K/V element, kvplay's
    # fused attention stores what sdpa's does, and each method compresses more as its bits shrink.
    arch = Arch.from_config(bundled[0].config)
    assert result["memory_bytes"]["baseline"]["256"] == 2 * arch.elements_per_token * 256
    mem = {spec: m["256"] for spec, m in result["memory"].items()}
    assert mem["baseline:attention=fused"] == mem["baseline:store=prealloc"] == 1.0
    for spec in FASTEST_16BIT:        # the same bytes in use, in buffers with 256 spare tokens
        assert result["allocated_bytes"][spec]["256"] == result["memory_bytes"]["baseline"]["256"] * (256 + 256) / 256
    assert 1 < mem["kvplay-int8"] < mem["kvplay-int4"] < mem["kvplay-int2"]
    assert 1 < mem["hqq-int8"] < mem["hqq-int4"] < mem["hqq-int2"] and 1 < mem["quanto-int4"] < mem["quanto-int2"]
    assert {t["target"].split(" ")[0] for t in result["targets"]} == {"kvplay-int4", "kvplay-int2:group=64"}
    assert 1 < mem["kvplay-int4"] < mem["kvplay-3bit"] < mem["kvplay-2.5bit"]      # fewer bits, fewer bytes
    assert "kvplay_cpu_kernel" in result["machine"] and result["peak_memory_bytes"] == {}   # CPU: no peak
    page = markdown(result)
    assert "## Targets" in page and "kvplay-int2:rotation=none" in page and "No GPU run" in page
    assert "against the fastest 16-bit path" in page
    assert "The fastest 16-bit path in each cell: 128 tokens, batch 1" in page

    # The CLI re-renders a saved result, with a GPU result as its own section, measuring nothing.
    saved, gpu, out = tmp_path / "cpu.json", tmp_path / "gpu.json", tmp_path / "bench.md"
    saved.write_text(json.dumps(result))
    gpu_result = {**result, "machine": {**result["machine"], "gpu": "Test GPU"},
                  "peak_memory_bytes": {s: 2**20 for s in result["memory"]}}
    gpu.write_text(json.dumps(gpu_result))
    assert main(["bench", "--from-json", str(saved), "--gpu-json", str(gpu), "--markdown", str(out)]) == 0
    page = out.read_text()
    assert "on Test GPU" in page and "peak GPU memory" in page and "No GPU run" not in page


def test_bench_from_a_missing_result_is_one_sentence(tmp_path, capsys):
    assert main(["bench", "--from-json", str(tmp_path / "nope.json"), "--markdown", str(tmp_path / "b.md")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: Cannot read a benchmark result from") and "Traceback" not in err


def _only(result: dict, specs) -> dict:
    """A bench result cut down to `specs`: what a run with only those specs would have written."""
    def cut(value):
        if isinstance(value, dict) and "baseline" in value:
            return {s: v for s, v in value.items() if s in specs}
        return {k: cut(v) for k, v in value.items()} if isinstance(value, dict) else value
    return {k: (cut(v) if k not in ("machine", "config") else v) for k, v in result.items()}


def test_real_model_suite_has_its_own_targets_and_section(smoke, tmp_path):
    """The real-model suite (REAL_BENCH_SPECS) is judged by its own targets and rendered as its own section;
    the smoke run on the bundled model stands in for it, so this checks the plumbing, not the figures."""
    from kvplay.lab.bench import REAL_BENCH_SPECS
    from kvplay.results.bench_targets import real_targets
    from kvplay.show.bench_page import real_section

    real = {**_only(smoke, REAL_BENCH_SPECS), "command": "pytest real smoke"}
    assert set(real["quality"]) == set(REAL_BENCH_SPECS)
    rows = targets(real)
    assert rows == real_targets(real)
    names = " ".join(t["target"] for t in rows)
    assert "kvplay-int2 delta PPL" in names and "kvplay-int4 mean KL vs quanto-int4's" in names
    k2 = real["quality"]["kvplay-int2"]
    holds = {t["target"]: t["holds"] for t in rows}
    assert holds["kvplay-int2 delta PPL"] == (k2["delta_ppl_pct"] <= 5)
    for batch, key in ((1, "decode_speed_vs_fastest_16bit"), (4, "decode_speed_batch4_vs_fastest_16bit")):
        row = next(t for t in rows if t["target"] == f"kvplay-int4 decode at 128 tokens, batch {batch}, vs the "
                                                       "fastest 16-bit path")
        value = real[key]["kvplay-int4"]["128"]
        assert row["measured"] == f"{value:.2f}x" and row["holds"] == (value >= (1.3 if batch == 1 else 1.8))
    assert "vs baseline" in names                              # the rows against DynamicCache stay
    older = {k: v for k, v in real.items() if "fastest" not in k}  # a run from before the fastest 16-bit path
    assert "fastest 16-bit" not in " ".join(t["target"] for t in targets(older))
    assert "predates the fastest 16-bit path" in real_section(older)
    saved, out = tmp_path / "real.json", tmp_path / "bench.md"
    saved.write_text(json.dumps(real))
    assert main(["bench", "--from-json", str(saved), "--real-json", str(saved), "--markdown", str(out)]) == 0
    page = out.read_text()
    section = page.split("## SmolLM2-135M-Instruct (the real model)")[1].split("## GPU")[0]
    assert "pytest real smoke" in section and "kvplay-int2 top-1 agreement" in section
    assert "### Decode speed against the fastest 16-bit path" in section and "vs the fastest 16-bit path" in section


def test_the_bit_budget_presets_are_judged_by_issue_27s_targets(smoke):
    """kvplay-3bit and kvplay-2.5bit: all-in bits at 8,192 tokens from the measured memory ratio, quality on the
    play and fused decode against kvplay-int4, each judged against its own goal (the smoke run's figures)."""
    from kvplay.lab.bench import REAL_BENCH_SPECS
    from kvplay.results.bench_targets import WHY_BITS, real_targets

    real = _only(smoke, REAL_BENCH_SPECS)
    real["memory"] = {s: {**m, "8192": m["256"]} for s, m in real["memory"].items()}     # as if measured at 8k
    rows = {t["target"]: t for t in real_targets(real)}
    for preset, bits, dppl, kl, top1 in (("kvplay-3bit", 3.5, 1, 0.01, 0.95), ("kvplay-2.5bit", 2.5, 5, 0.05, 0.9)):
        q, ratio = real["quality"][preset], real["memory"][preset]["8192"]
        assert rows[f"{preset} bits per element at 8,192 tokens"]["holds"] == (16 / ratio <= bits)
        assert rows[f"{preset} delta PPL"]["holds"] == (q["delta_ppl_pct"] <= dppl)
        assert rows[f"{preset} mean KL"]["holds"] == (q["mean_kl"] <= kl)
        assert rows[f"{preset} top-1 agreement"]["holds"] == (q["top1_agreement"] >= top1)
        speed = real["decode_speed"][preset]["128"] / real["decode_speed"]["kvplay-int4"]["128"]
        assert rows[f"{preset} decode at 128 tokens, batch 1, vs kvplay-int4"]["holds"] == (speed >= 1)
        assert all(rows[name]["why"] == WHY_BITS for name in rows if name.startswith(preset))


def test_a_missed_target_links_to_its_reason_and_the_hand_written_part_survives_a_rewrite(smoke, tmp_path):
    from kvplay.lab.bench import REAL_BENCH_SPECS
    from kvplay.show.bench_page import KEPT

    real = _only(smoke, REAL_BENCH_SPECS)
    real["compare_cli"] = {"ratio": 2.0, "median": {"compare": {"wall_s": 14.0, "cpu_s": 22.0},
                                                   "baseline": {"wall_s": 7.0, "cpu_s": 9.0}}}
    saved, out = tmp_path / "real.json", tmp_path / "bench.md"
    saved.write_text(json.dumps(real))
    out.write_text(f"# an old page\n\nold tables\n\n{KEPT}\n\n## Compare in lockstep (issue 24)\n\nwhy it misses\n")
    assert main(["bench", "--from-json", str(saved), "--real-json", str(saved), "--markdown", str(out)]) == 0
    page = out.read_text()
    assert "old tables" not in page and page.count(KEPT) == 1
    assert page.endswith("## Compare in lockstep (issue 24)\n\nwhy it misses\n")
    row = next(line for line in page.splitlines() if line.startswith("| default Compare / 16-bit baseline alone"))
    assert row.endswith("| **no** ([why](#compare-in-lockstep-issue-24)) |")
    assert "| 16-bit baseline alone, whole CLI run | 7.0 s | <= 12 s | yes |" in page
    out.write_text("# a page with nothing written by hand\n")                 # nothing to keep: the new page alone
    assert main(["bench", "--from-json", str(saved), "--markdown", str(out)]) == 0
    assert KEPT not in out.read_text() and "a page with nothing" not in out.read_text()


def test_every_cache_is_also_quoted_against_the_fastest_16_bit_path_of_the_same_run(smoke):
    """Per cell, the fastest 16-bit path is the faster preallocated 16-bit row of that cell, and every ratio to it
    is that cell's tokens/s over its tokens/s: the same run's figures, within what their rounding allows (tokens/s
    to 0.01, ratios to 4 decimals; the largest difference measured was 1.1e-4 of the ratio)."""
    for batch, vs in ((1, smoke["decode_speed_vs_fastest_16bit"]), (4, smoke["decode_speed_batch4_vs_fastest_16bit"])):
        absolute = smoke["decode_tokens_per_s"][f"ctx128_b{batch}"]
        top = smoke["fastest_16bit"][f"ctx128_b{batch}"]
        assert top == max(FASTEST_16BIT, key=absolute.get)
        assert vs[top]["128"] == 1.0 and all(vs[s]["128"] <= 1.0 for s in FASTEST_16BIT)
        for spec in BENCH_SPECS:
            ratio = absolute[spec] / absolute[top]
            rounding = 5e-5 + ratio * 0.005 * (1 / absolute[spec] + 1 / absolute[top])
            assert abs(vs[spec]["128"] - ratio) <= rounding * 1.01, spec


@pytest.mark.slow
def test_whole_cli_runs_of_compare_and_the_baseline_alone_are_timed_and_judged(smoke):
    """The real-model suite's first targets (issue 24) come from whole `kvplay compare` processes, the default Compare
    and the baseline alone, taking turns; on the bundled model the default Compare does more work than the baseline
    alone (4 caches besides it, each free-running and teacher-forced), so it takes more CPU seconds. Wall time is only
    reported and judged, not asserted: on CI's busy machine the two wall times came out equal (ratio 1.0, baseline
    7.8 CPU s), since start-up dominates a tiny model's run."""
    from kvplay.lab.bench import REAL_BENCH_SPECS, compare_cli_runs
    from kvplay.results.bench_targets import real_targets

    cli = compare_cli_runs("shakespeare-llama", 1)
    assert [len(v) for v in cli["runs"].values()] == [1, 1]
    compare, baseline = cli["median"]["compare"], cli["median"]["baseline"]
    assert compare["cpu_s"] > baseline["cpu_s"] > 0 and cli["ratio"] > 0
    rows = {t["target"]: t for t in real_targets({**_only(smoke, REAL_BENCH_SPECS), "compare_cli": cli})}
    row = rows["default Compare / 16-bit baseline alone, whole CLI runs"]
    assert row["measured"].startswith(f"{cli['ratio']:.2f}x") and row["holds"] == (cli["ratio"] <= 1.5)
    assert rows["16-bit baseline alone, whole CLI run"]["holds"] == (baseline["wall_s"] <= 12)
