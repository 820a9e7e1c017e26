"""A GGUF file's first load, made faster without changing a value: transformers converts a GGUF with the gguf
package, and four things in how they meet cost most of a 1.5B model's conversion on 2 cores.

    with fast_gguf():            # what kvplay.app.models holds around from_pretrained of a GGUF
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, ...)

- transformers reads the file's metadata three times (for the tokenizer, the config and the weights), and a read
  is mostly the vocabulary: 9-11 s a read of Qwen2.5-Coder-0.5B's 151,936 tokens. Readers of one path are shared.
- The reader indexes an np.memmap, whose indexing runs in Python: 13 million times in a 1.5B GGUF's load. It reads
  a plain array view of the same memory map instead (the read 6.0 -> 1.7 s on Qwen2.5-Coder-1.5B).
- Dequantization runs in groups of 16 rows, so a 4-bit matrix costs thousands of small numpy calls. It runs in
  groups of about 4 MB of blocks instead, on as many threads as torch uses (numpy releases the GIL), with the same
  per-block arithmetic: the values are equal to the bit (tests/test_gguf_read.py).
- transformers builds gguf's table of tensor names once per module of the model (371 times for a 1.5B Qwen2, 4.0 s
  under a profiler). The table depends only on the architecture and the layer count, so it is built once.

The lock keeps two loads from swapping gguf's functions under each other.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

_LOCK = threading.Lock()
GROUP_BYTES = 4 << 20         # a group of rows dequantized at once: large enough that numpy's calls are few


def grouped_rows(func, arr: np.ndarray, otype, oshape: tuple[int, ...]) -> np.ndarray:
    """gguf.quants._apply_over_grouped_rows with groups of about GROUP_BYTES, spread over torch's threads."""
    rows = arr.reshape((-1, arr.shape[-1]))
    groups = max(1, min(rows.shape[0], rows.nbytes // GROUP_BYTES))
    parts = np.array_split(rows, groups)
    out = np.empty(oshape, dtype=otype).reshape(len(rows), -1)
    starts = np.cumsum([0] + [len(p) for p in parts])

    def one(i: int) -> None:
        out[starts[i]:starts[i + 1]] = func(parts[i]).reshape(len(parts[i]), -1)
    threads = max(1, min(torch.get_num_threads(), groups))
    if threads == 1:
        for i in range(groups):
            one(i)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(groups)))
    return out.reshape(oshape)


@contextlib.contextmanager
def fast_gguf():
    """While held, gguf's reader is shared per path and reads a plain array, dequantization runs in large groups on
    torch's threads, and the table of tensor names is built once per architecture and layer count."""
    import gguf
    from gguf import quants

    with _LOCK:
        real_reader, real_rows, readers = gguf.GGUFReader, quants._apply_over_grouped_rows, {}
        real_names = gguf.get_tensor_name_map

        class ArrayReader(real_reader):
            @property
            def data(self):
                return self._array

            @data.setter
            def data(self, value):
                self._array = value.view(np.ndarray)

        def reader(path, mode="r"):
            if (str(path), mode) not in readers:
                readers[str(path), mode] = ArrayReader(path, mode)
            return readers[str(path), mode]
        gguf.GGUFReader, quants._apply_over_grouped_rows = reader, grouped_rows
        gguf.get_tensor_name_map = functools.cache(real_names)
        try:
            yield
        finally:
            gguf.GGUFReader, quants._apply_over_grouped_rows = real_reader, real_rows
            gguf.get_tensor_name_map = real_names
