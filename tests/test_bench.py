"""A smoke run of the benchmark, so it cannot rot: every JSON field is there. Nothing about speed."""
import json

from kvplay.bench import BENCH_SPECS, BenchConfig, markdown, run_bench, targets
from kvplay.cli import main


def test_benchmark_smoke_run_has_every_field(bundled, tmp_path):
    model, tok = bundled
    result = run_bench(model, tok, config=BenchConfig.smoke(), command="pytest smoke")
    result["targets"] = targets(result)
    json.loads(json.dumps(result))                      # serialisable
    for key in ("memory", "limits", "decode_speed", "decode_speed_batch4", "quality", "machine", "command"):
        assert key in result, key
    for spec in BENCH_SPECS:
        assert set(result["memory"][spec]) == {"256"} and result["limits"][spec]["256"] > 0
        assert set(result["decode_speed"][spec]) == {"128"} and result["decode_speed"][spec]["128"] > 0
        assert set(result["decode_speed_batch4"][spec]) == {"128"}
        assert {"delta_ppl_pct", "mean_kl", "top1_agreement"} <= set(result["quality"][spec])
    assert result["memory"]["baseline"]["256"] == 1.0 and result["decode_speed"]["baseline"]["128"] == 1.0
    assert {t["target"].split(" ")[0] for t in result["targets"]} == {"kvplay-int4", "kvplay-int2:group=64"}
    assert "kvplay_cpu_kernel" in result["machine"] and result["peak_memory_bytes"] == {}   # CPU: no peak
    page = markdown(result)
    assert "## Targets" in page and "kvplay-int2:rotation=hadamard" in page and "No GPU run" in page

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
