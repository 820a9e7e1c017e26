"""A smoke run of the benchmark, so it cannot rot: every JSON field is there. Nothing about speed."""
import json

from kvplay.bench import BENCH_SPECS, BenchConfig, markdown, run_bench, targets


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
    page = markdown(result)
    assert "## Targets" in page and "kvplay-int2:rotation=hadamard" in page
