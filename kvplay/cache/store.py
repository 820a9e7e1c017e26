"""How kvplay's engine stores what leaves the 16-bit window: a tensor format (int or fp8, grouped per channel
across a block's tokens or per token across head_dim) and an append-only store of quantized blocks.

    fmt = TensorFormat("int", 2, "channel", 32)
    store = BlockStore(fmt, ...)            # grows by whole blocks, never re-quantizes one
    assemble(sink, store, window, n, rot)   # (B, H, S + N + W, D): what the dequantize path hands attention

engine.py builds layers from these; attention.py's fused kernel reads the packed blocks directly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvplay.cache import kernels, quant


@dataclass(frozen=True)
class TensorFormat:
    """How one kind of tensor (keys or values) is stored once it leaves the window."""

    fmt: str        # "int" or "fp8"
    bits: int       # 2, 3, 4, 8 (fp8: 8)
    grouping: str   # "channel": groups span the tokens of a block; "token": groups span head_dim
    group: int      # elements per group (channel grouping: tokens per block)
    fit: str = "minmax"  # "mse": scale and zero refitted by least squares (quant.quantize_int); same bytes
    meta: str = "fp16"   # each group's scale and zero: "fp16" (4 bytes) or "8bit" (2 bytes; quant.METAS)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x (B, H, n, T, D) float32, n blocks of T tokens -> stored tensors, each (B, H, n, ...).

        Codes are always packed along head_dim, so dequantized blocks come out token-major,
        (T, D), with no transpose; channel grouping only changes where scales and zeros sit.
        """
        if self.fmt == "fp8":
            q = quant.quantize_fp8(x, check_finite=False)
            return q.data, q.scale                                   # (B,H,n,T,D), (B,H,n,T,1)
        if self.grouping == "channel":                               # one group per channel of a block
            q = quant.quantize_int(x, self.bits, axis=-2, check_finite=False, fit=self.fit, meta=self.meta)
            return q.packed, q.scale, q.zero                         # (B,H,n,T,P(D)), (B,H,n,1,D) x2
        q = quant.quantize_int(x.unflatten(-1, (-1, self.group)), self.bits, check_finite=False, fit=self.fit,
                               meta=self.meta)
        return q.packed, q.scale, q.zero                             # (B,H,n,T,D/g,P(g)), (B,H,n,T,D/g,1) x2

    def decode(self, stored: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        """Inverse of encode, written into out (B, H, n * T, D) in its dtype (rows contiguous).

        On the CPU the compiled kernel does it in one pass (see kernels.py); the eager path
        below computes the same numbers and serves the GPU, 3 bits, float16 and 8-bit metadata.
        """
        if self.fmt == "fp8":  # data (B,H,n,T,D), scale (B,H,n,T,1)
            data, scale = stored
            if not kernels.dequantize_fp8_rows(data.flatten(2, 3), scale.flatten(2, 3), out):
                out.copy_(quant.dequantize_fp8(quant.QuantizedFp8(*stored), torch.float32).flatten(2, 3))
            return
        packed, scale, zero = stored
        if self.grouping == "channel":  # packed (B,H,n,T,P(D)); scale, zero (B,H,n,1,D)
            block = packed.shape[3]
            if kernels.dequantize_rows(packed.flatten(2, 3).unsqueeze(3), scale.squeeze(3), zero.squeeze(3), out,
                                       bits=self.bits, group=out.shape[-1], rows_per_scale=block, per_code=True):
                return
            view = out.unflatten(2, (-1, block))                            # (B, H, n, T, D)
            quant.dequantize_int(quant.QuantizedInt(*stored), self.bits, out.shape[-1], out.dtype, out=view)
            return
        # packed (B,H,n,T,D/g,P(g)); scale, zero (B,H,n,T,D/g,1)
        if kernels.dequantize_rows(packed.flatten(2, 3), scale.flatten(2, 3).squeeze(-1),
                                   zero.flatten(2, 3).squeeze(-1), out, bits=self.bits, group=self.group,
                                   rows_per_scale=1, per_code=False):
            return
        view = out.unflatten(2, (packed.shape[2], -1)).unflatten(-1, (-1, self.group))  # (B, H, n, T, D/g, g)
        quant.dequantize_int(quant.QuantizedInt(*stored), self.bits, self.group, out.dtype, out=view)


SPARE_TOKENS = 16   # a store grows by its need plus this many tokens' worth of blocks (at least one block)


class BlockStore:
    """Append-only quantized blocks in preallocated buffers with at most one spare block (see _grow).

    Buffers are (B, H, capacity, ...): dequantizing the whole history is one call on
    the first n_blocks slices, and appending writes in place.
    """

    def __init__(self, fmt: TensorFormat, block: int, head_dim: int):
        self.fmt, self.block, self.head_dim = fmt, block, head_dim
        self.buffers: list[torch.Tensor] = []
        self.n_blocks = 0

    def append(self, x: torch.Tensor) -> None:
        """x (B, H, n, T, D) float32."""
        encoded = self.fmt.encode(x)
        n = x.shape[2]
        if not self.buffers or self.n_blocks + n > self.buffers[0].shape[2]:
            self._grow(self.n_blocks + n, encoded)
        for buf, part in zip(self.buffers, encoded):
            buf[:, :, self.n_blocks:self.n_blocks + n] = part
        self.n_blocks += n

    def _grow(self, needed: int, like: tuple[torch.Tensor, ...]) -> None:
        """Reallocate to `needed` blocks plus SPARE_TOKENS' worth (at least one block): waste stays within one
        block per stream, and a copy of the store every block or so costs far less than a decode step."""
        cap = needed + max(1, -(-SPARE_TOKENS // self.block))
        new = [p.new_empty(p.shape[:2] + (cap,) + p.shape[3:]) for p in like]
        for old, buf in zip(self.buffers, new):
            buf[:, :, :self.n_blocks] = old[:, :, :self.n_blocks]
        self.buffers = new

    def used(self, n: int | None = None) -> tuple[torch.Tensor, ...]:
        """The first n (default: all) stored blocks of each buffer."""
        return tuple(b[:, :, :self.n_blocks if n is None else n] for b in self.buffers)

    def dequantize_into(self, out: torch.Tensor, n: int | None = None) -> None:
        """Write the first n (default: all) blocks' tokens into out (B, H, n * T, D), in out's dtype."""
        self.fmt.decode(self.used(n), out)

    def dequantize(self, dtype=torch.float32, n: int | None = None) -> torch.Tensor:
        """The first n (default: all) blocks' tokens, (B, H, n * T, D)."""
        b, h = self.buffers[0].shape[:2]
        n = self.n_blocks if n is None else n
        out = self.buffers[0].new_empty((b, h, n * self.block, self.head_dim), dtype=dtype)
        self.dequantize_into(out, n)
        return out

    def select_batch(self, index: torch.Tensor) -> None:
        self.buffers = [b.index_select(0, index.to(b.device)) for b in self.buffers]

    def repeat_batch(self, repeats: int) -> None:
        self.buffers = [b.repeat_interleave(repeats, dim=0) for b in self.buffers]

    def nbytes(self) -> tuple[int, int]:
        """(payload, metadata) bytes in use: codes, then scales and zero points."""
        used = self.used()
        sizes = [t.numel() * t.element_size() for t in used]
        return (sizes[0], sum(sizes[1:])) if sizes else (0, 0)

    def allocated(self) -> int:
        """Bytes the buffers hold, spare capacity included."""
        return sum(b.untyped_storage().nbytes() for b in self.buffers)


def assemble(sink: torch.Tensor, store: BlockStore, window: torch.Tensor, n_blocks: int,
             rotation: torch.Tensor | None) -> torch.Tensor:
    """One (B, H, S + N + W, D) tensor: sink, the store's first n_blocks dequantized (in place), window. rotation:
    None, (D, D) or (H, D, D) (one per head), the one the blocks were stored under."""
    s, n = sink.shape[-2], n_blocks * store.block
    if n == 0:
        return torch.cat([sink, window], dim=-2) if s else window
    out = window.new_empty(window.shape[:2] + (s + n + window.shape[-2], window.shape[-1]))
    out[:, :, :s] = sink
    if rotation is None:
        store.dequantize_into(out[:, :, s:s + n], n_blocks)
    else:
        out[:, :, s:s + n] = store.dequantize(n=n_blocks) @ rotation.mT       # undo the rotation
    out[:, :, s + n:] = window
    return out
