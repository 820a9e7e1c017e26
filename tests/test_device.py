"""The views on the device KVPLAY_TEST_DEVICE names (cpu by default; scripts/gpu_check.py runs them with cuda):
Compare, quality and exact cache bytes on the bundled model, loaded there. Marked `device`: `pytest -m device`."""
import os

import pytest
import torch

from kvplay.app import compare, quality
from kvplay.app.models import load_model
from kvplay.app.settings import Settings
from kvplay.cache import analytic_nbytes, build_cache, cache_nbytes
from kvplay.cache.arch import Arch
from kvplay.lab.generate import prefill

DEVICE = os.environ.get("KVPLAY_TEST_DEVICE", "cpu")
pytestmark = [pytest.mark.device,
              pytest.mark.skipif(DEVICE.startswith("cuda") and not torch.cuda.is_available(),
                                 reason=f"KVPLAY_TEST_DEVICE={DEVICE}, and this machine has no CUDA GPU")]
SPECS = ["kvplay-int4:residual=16", "kvplay-int2:residual=16", "quanto-int4:residual=16"]
PROMPT = 3 * ("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings and "
              "arrows of outrageous fortune, or to take arms against a sea of troubles. ")   # past a window and a block


def test_compare_runs_every_cache_on_the_device_and_the_16_bit_cache_is_its_own_reference():
    result = compare.compare("shakespeare-llama", SPECS, PROMPT, 16, device=DEVICE,
                              settings=Settings())
    assert result.env.device.startswith(DEVICE) and [c.spec for c in result.caches] == ["baseline", *SPECS]
    base = result.caches[0]
    assert len(base.token_ids) == 16 and base.mean_kl == 0 and base.match_fraction == 1
    for run in result.caches[1:]:
        assert len(run.token_ids) == 16 and run.bits_per_element < 16 and run.mean_kl >= 0, run.spec


def test_quality_on_the_device_orders_the_caches_by_their_bits():
    result = quality.ppl("shakespeare-llama", SPECS[:2],
                          max_tokens=256, device=DEVICE, settings=Settings())
    assert result.env.device.startswith(DEVICE)
    base, int4, int2 = result.caches
    assert base.mean_kl == 0 and base.delta_ppl_pct == 0
    assert 0 < int4.mean_kl < int2.mean_kl            # measured on CPU: 0.000096 and 0.0026


@pytest.mark.parametrize("spec", ["baseline", "kvplay-int4", "kvplay-int2:residual=16"])
def test_the_cache_holds_exactly_the_bytes_of_its_formula_on_the_device(spec):
    model, _ = load_model("shakespeare-llama", device=DEVICE)
    ids = torch.arange(300, device=model.device).remainder(4000)[None] + 10          # (1, 300)
    cache = build_cache(spec, model)
    with torch.inference_mode():
        prefill(model, ids, torch.ones_like(ids), cache)
    assert cache_nbytes(cache).total == analytic_nbytes(spec, Arch.from_config(model.config), 300).total
