"""kvplay.app.gguf_read: a GGUF's first load dequantizes in large groups on torch's threads, with gguf's own
per-block arithmetic, so every value equals what gguf gives to the bit, for every type gguf dequantizes."""
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from kvplay.app import gguf_read

TYPES = [t for t in GGMLQuantizationType if t in quants._type_traits]


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_grouped_dequantization_gives_gguf_s_values_to_the_bit(qtype, two_threads, monkeypatch):
    block, size = GGML_QUANT_SIZES[qtype]
    rows, blocks = 300, 3
    data = np.random.default_rng(int(qtype)).integers(0, 256, (rows, blocks * size), dtype=np.uint8)
    theirs = quants.dequantize(data, qtype)
    monkeypatch.setattr(gguf_read, "GROUP_BYTES", data.nbytes // 7)     # 7 groups of uneven rows, on 2 threads
    with gguf_read.fast_gguf():
        ours = quants.dequantize(data, qtype)
    assert ours.shape == theirs.shape == (rows, blocks * block)
    assert np.array_equal(ours, theirs, equal_nan=True)       # random bytes make some scales NaN: equal there too
    assert quants._apply_over_grouped_rows is not gguf_read.grouped_rows      # gguf's own again after the load


def test_gguf_s_functions_are_its_own_again_after_a_load_even_one_that_fails():
    import gguf

    before = (gguf.GGUFReader, gguf.get_tensor_name_map, quants._apply_over_grouped_rows)
    with pytest.raises(RuntimeError), gguf_read.fast_gguf():
        assert gguf.GGUFReader is not before[0] and gguf.get_tensor_name_map is not before[1]
        raise RuntimeError("a load that fails halfway")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map, quants._apply_over_grouped_rows) == before
