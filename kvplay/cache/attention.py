"""Decode attention straight from the packed cache: the "kvplay" attention implementation.

    model = AutoModelForCausalLM.from_pretrained(MODEL, attn_implementation="kvplay")  # after importing kvplay
    cache = build_cache("kvplay-int4", model)       # decode attention: fused from packed codes

A cache built for a model whose config._attn_implementation is "kvplay" hands attention, on a CPU
decode step (one new token), two placeholder tensors instead of a dequantized 16-bit history: stride-0
views of one zero, shaped (B, H, seen, D), that own no memory and carry a `kvplay_view` (a DecodeView:
the layer's 16-bit sink, its first n quantized blocks and its 16-bit window as they were at that step).
kvplay_attention(), registered with transformers' AttentionInterface, recognises them and runs
csrc/attend.c on the codes; anything else (other caches, prefill, sliding layers) goes to transformers'
own sdpa_attention_forward with the tensors it got. A model with any other attention implementation
never receives placeholders: the cache decides at build time from the model's config.

The kernel covers integer keys grouped per channel and values grouped per token at 2, 4 or 8 bits, with float16
or 8-bit scales and zeros (the kvplay-int2, kvplay-int4, kvplay-2.5bit and kvplay-3bit presets, rotated or not;
covers()), llama.cpp's quantized blocks (q8_0, q4_0, q4_1,
q5_0, q5_1, iq4_nl) for keys and values in any pairing, rotated as llama.cpp does or not (the llamacpp-* caches;
covers_ggml(): the view is then N one-token blocks with no sink and no window, and keys and values may have
rotations of their own),
and plain 16-bit caches (baseline:attention=fused); everything else keeps dequantize-then-attend.

Several caches stepping as one batch (rows.RowGroups, Compare's lockstep) hand attention placeholders
carrying `kvplay_rows` instead: B rows per cache and each cache's own keys and values. kvplay_attention
then attends group by group, each exactly as that cache would alone (fused or sdpa), and joins the outputs.
"""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvplay.cache import ggml, kernels, quant
from kvplay.cache.store import assemble

NAME = "kvplay"
MAX_GROUP, MAX_HEAD_DIM = 16, 256          # query heads per KV head, head_dim (attend.c's MAX_G, MAX_D)
CHUNK = 256                                # tokens per work item (threads share the chunks)
ISAS = ("auto", "c", "avx2", "avx512")     # attend.c's code paths: "auto" takes the best the CPU has
ISA = "auto"                               # tests pin each path by setting this
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# llama.cpp's cache types the kernel reads: attend.c's GGML_Q8_0 ... GGML_IQ4_NL (all of ggml.TYPES but f16)
GGML_TYPES = {"q8_0": 1, "q4_0": 2, "q4_1": 3, "q5_0": 4, "q5_1": 5, "iq4_nl": 6}
# Keyword arguments some models pass that the kernel does not implement: with any of them set, the
# placeholders are turned back into real tensors and sdpa runs.
_UNSUPPORTED = ("softcap", "s_aux", "sinks", "position_bias", "sliding_window")
# A key tensor may carry, in this attribute, functions f(query, scaling) that kvplay_attention calls after it has
# attended, with that cache's queries (B, Hq, q, D): how an evicting cache scores its tokens (kvplay.cache.evict).
AFTER = "kvplay_after"

_p, _i64, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_METAS = ("fp16", "8bit")                  # quant.METAS: attend_t.kmeta8 / vmeta8 flag the second
_META8_TABLE: torch.Tensor | None = None   # quant._meta8_table on the CPU, the 256 scales attend_t.meta8 reads


def _meta8_table() -> torch.Tensor:
    global _META8_TABLE
    if _META8_TABLE is None:
        _META8_TABLE = quant._meta8_table(torch.device("cpu")).contiguous()
    return _META8_TABLE


class _Job(ctypes.Structure):
    """attend_t in csrc/attend.c, field for field."""

    _fields_ = [("B", _i64), ("Hkv", _i64), ("G", _i64), ("D", _i64), ("query", _p), ("query_dtype", _int),
                ("query_b", _i64), ("query_h", _i64), ("scaling", ctypes.c_float), ("q", _p), ("q_rot", _p),
                ("rot", _p), ("mask", _p), ("mask_b", _i64), ("dtype16", _int),
                ("sink_k", _p), ("sink_v", _p), ("S", _i64), ("sink_b", _i64), ("sink_h", _i64),
                ("win_k", _p), ("win_v", _p), ("W", _i64), ("win_b", _i64), ("win_h", _i64),
                ("N", _i64), ("T", _i64), ("kp", _p), ("kp_b", _i64), ("kp_h", _i64), ("ks", _p), ("kz", _p),
                ("km_b", _i64), ("km_h", _i64), ("kbits", _int), ("vp", _p), ("vp_b", _i64), ("vp_h", _i64),
                ("vs", _p), ("vz", _p), ("vm_b", _i64), ("vm_h", _i64), ("vbits", _int), ("vg", _i64),
                ("out", _p), ("out_dtype", _int), ("chunk", _i64), ("threads", _int), ("isa", _int),
                ("kggml", _int), ("vggml", _int), ("rot_v", _p), ("kmin", _p), ("vmin", _p), ("khi", _p), ("vhi", _p),
                ("khi_b", _i64), ("khi_h", _i64), ("vhi_b", _i64), ("vhi_h", _i64),
                ("kmeta8", _int), ("vmeta8", _int), ("meta8", _p), ("rot_h", _i64)]


def _library():
    lib = kernels.library("attend")
    if lib is not None and not hasattr(lib, "_kvplay_declared"):
        lib.kvplay_attend.restype = ctypes.c_int
        lib.kvplay_attend.argtypes = [ctypes.POINTER(_Job)]
        lib._kvplay_declared = True
    return lib


def available() -> bool:
    """Whether the fused attention kernel is built and enabled (builds it on the first call)."""
    return _library() is not None


def covers(key_fmt, value_fmt, head_dim: int) -> bool:
    """Whether the kernel reads this storage: integer keys per channel, values per token, 2/3/4/8 bits (3 bits: a
    key row and a value group a whole number of 8-code chunks), float16 or 8-bit scales and zeros (quant.METAS)."""
    return (key_fmt.fmt == value_fmt.fmt == "int" and key_fmt.grouping == "channel" and value_fmt.grouping == "token"
            and key_fmt.bits in (2, 3, 4, 8) and value_fmt.bits in (2, 3, 4, 8) and head_dim <= MAX_HEAD_DIM
            and head_dim * key_fmt.bits % 8 == 0 and head_dim % value_fmt.group == 0
            and (key_fmt.bits != 3 or head_dim % 8 == 0) and (value_fmt.bits != 3 or value_fmt.group % 8 == 0)
            and key_fmt.meta in _METAS and value_fmt.meta in _METAS)


def covers_ggml(key_type: str, value_type: str, head_dim: int) -> bool:
    """Whether the kernel reads llama.cpp's blocks of these ggml types (kvplay/cache/ggml.py) for keys and values."""
    return key_type in GGML_TYPES and value_type in GGML_TYPES and head_dim <= MAX_HEAD_DIM and head_dim % 32 == 0


def model_uses_it(config) -> bool:
    """Whether a model with this config calls kvplay_attention (its attention implementation is "kvplay")."""
    return getattr(config, "_attn_implementation", None) == NAME


@dataclass
class DecodeView:
    """What one decode step attends to: [sink | store's first n_blocks | window], the new token last.

    sink_k, sink_v, window_k, window_v (B, H, *, D) 16-bit (shapes and dtype come from window_k, which may hold
    no token); store_k, store_v BlockStores or None (16-bit caches); rotation (D, D), (H, D, D) (one per KV head:
    kvplay's rotation=calibrated keys) or None, the quantized part's (keys' and values'; rotation_v the values'
    where it differs), float32. ggml: (key type, value type) when the
    stores hold llama.cpp's one-token blocks (llamacpp.GgmlFormat, a type of GGML_TYPES: "q4_0", ...), None for
    kvplay's TensorFormat. The store is append-only, so its first n_blocks stay as they were.
    """

    sink_k: torch.Tensor
    sink_v: torch.Tensor
    window_k: torch.Tensor
    window_v: torch.Tensor
    store_k: object = None
    store_v: object = None
    n_blocks: int = 0
    block: int = 1
    rotation: torch.Tensor | None = None
    ggml: tuple[str, str] | None = None
    rotation_v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return self.sink_k.shape[-2] + self.n_blocks * self.block + self.window_k.shape[-2]

    def placeholders(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Two (B, H, length, D) stride-0 views of one zero, each carrying this view."""
        b, h, _, d = self.window_k.shape
        zero = self.window_k.new_zeros(())
        keys, values = zero.expand(b, h, self.length, d), zero.expand(b, h, self.length, d)
        keys.kvplay_view = values.kvplay_view = self
        return keys, values

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The 16-bit keys and values the dequantize path would hand attention, (B, H, length, D) each."""
        if self.store_k is None:
            return self.window_k, self.window_v
        rotation_v = self.rotation if self.rotation_v is None else self.rotation_v
        return (assemble(self.sink_k, self.store_k, self.window_k, self.n_blocks, self.rotation),
                assemble(self.sink_v, self.store_v, self.window_v, self.n_blocks, rotation_v))

    def attend(self, query: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> torch.Tensor | None:
        """query (B, Hq, 1, D) -> attention output (B, 1, Hq, D) in query's dtype, or None if the kernel cannot."""
        lib = _library()
        b, hq, _, d = query.shape
        hkv = self.window_k.shape[1]
        if (lib is None or query.device.type != "cpu" or hq % hkv or hq // hkv > MAX_GROUP
                or self.window_k.dtype not in _DTYPES or d > MAX_HEAD_DIM
                or not all(r is None or (r.dtype == torch.float32 and r.is_contiguous() and r.shape in ((d, d), shape))
                           for r, shape in ((self.rotation, (hkv, d, d)), (self.rotation_v, (d, d))))):
            return None
        dtype = query.dtype
        if query.stride(-1) != 1 or dtype not in _DTYPES:
            query = query.float().contiguous()
        # (B, 1, Hq, D): the layout attention returns; bfloat16 and float32 written by the kernel itself
        out = query.new_empty(b, 1, hq, d, dtype=query.dtype if query.dtype != torch.float16 else torch.float32)
        bias = _mask_bias(mask, self.length)                                      # (B or 1, L) float32 or None
        sk, sv, wk, wv = (_rows(t) for t in (self.sink_k, self.sink_v, self.window_k, self.window_v))
        job = _Job(B=b, Hkv=hkv, G=hq // hkv, D=d, query=query.data_ptr(), query_dtype=_DTYPES[query.dtype],
                   query_b=query.stride(0), query_h=query.stride(1), scaling=scaling,
                   rot=self.rotation.data_ptr() if self.rotation is not None else None,
                   mask=bias.data_ptr() if bias is not None else None,
                   mask_b=bias.stride(0) if bias is not None and bias.shape[0] > 1 else 0,
                   dtype16=_DTYPES[wk.dtype], sink_k=sk.data_ptr(), sink_v=sv.data_ptr(), S=sk.shape[2],
                   sink_b=sk.stride(0), sink_h=sk.stride(1), win_k=wk.data_ptr(), win_v=wv.data_ptr(),
                   W=wk.shape[2], win_b=wk.stride(0), win_h=wk.stride(1), N=self.n_blocks, T=self.block,
                   out=out.data_ptr(), out_dtype=_DTYPES[out.dtype], chunk=CHUNK, threads=torch.get_num_threads(),
                   isa=ISAS.index(ISA), rot_v=self.rotation_v.data_ptr() if self.rotation_v is not None else None,
                   rot_h=d * d if self.rotation is not None and self.rotation.dim() == 3 else 0)
        if self.n_blocks and self.ggml is not None:
            # each (B, H, cap, 1, D/32, ...): qs 32 int8 or 16 bytes of nibbles, qh 4 bytes, d and m 1 float16
            k = dict(zip(ggml.PARTS[self.ggml[0]], self.store_k.buffers))
            v = dict(zip(ggml.PARTS[self.ggml[1]], self.store_v.buffers))
            job.kp, job.kp_b, job.kp_h = k["qs"].data_ptr(), k["qs"].stride(0), k["qs"].stride(1)
            job.ks, job.km_b, job.km_h = k["d"].data_ptr(), k["d"].stride(0), k["d"].stride(1)
            job.vp, job.vp_b, job.vp_h = v["qs"].data_ptr(), v["qs"].stride(0), v["qs"].stride(1)
            job.vs, job.vm_b, job.vm_h = v["d"].data_ptr(), v["d"].stride(0), v["d"].stride(1)
            if any("m" in p and p["m"].stride() != p["d"].stride() for p in (k, v)):
                return None                                                   # m is read with d's strides
            job.kmin = k["m"].data_ptr() if "m" in k else None
            job.vmin = v["m"].data_ptr() if "m" in v else None
            if "qh" in k:
                job.khi, job.khi_b, job.khi_h = k["qh"].data_ptr(), k["qh"].stride(0), k["qh"].stride(1)
            if "qh" in v:
                job.vhi, job.vhi_b, job.vhi_h = v["qh"].data_ptr(), v["qh"].stride(0), v["qh"].stride(1)
            job.kggml, job.vggml = GGML_TYPES[self.ggml[0]], GGML_TYPES[self.ggml[1]]
        elif self.n_blocks:
            kp, ks, kz = self.store_k.buffers      # (B,H,cap,T,P), (B,H,cap,1,D) x2
            vp, vs, vz = self.store_v.buffers      # (B,H,cap,T,D/g,Pg), (B,H,cap,T,D/g,1) x2
            job.kp, job.kp_b, job.kp_h = kp.data_ptr(), kp.stride(0), kp.stride(1)
            job.ks, job.kz, job.km_b, job.km_h = ks.data_ptr(), kz.data_ptr(), ks.stride(0), ks.stride(1)
            job.vp, job.vp_b, job.vp_h = vp.data_ptr(), vp.stride(0), vp.stride(1)
            job.vs, job.vz, job.vm_b, job.vm_h = vs.data_ptr(), vz.data_ptr(), vs.stride(0), vs.stride(1)
            job.kbits, job.vbits = self.store_k.fmt.bits, self.store_v.fmt.bits
            job.vg = self.store_v.fmt.group
            job.kmeta8, job.vmeta8 = self.store_k.fmt.meta == "8bit", self.store_v.fmt.meta == "8bit"
            if job.kmeta8 or job.vmeta8:
                if ks.stride() != kz.stride() or vs.stride() != vz.stride():
                    return None                                       # zeros are read with the scales' strides
                job.meta8 = _meta8_table().data_ptr()
        else:
            job.kbits = job.vbits = 8
            job.vg = d
        if lib.kvplay_attend(ctypes.byref(job)) != 0:
            return None
        return out.to(dtype)                                                      # (B, 1, Hq, D)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t (B, H, n, D) as attend.c reads it: rows of D contiguous per (b, h), at any batch and head strides. A view
    of a preallocated buffer's first n tokens already is (no copy); anything else becomes a contiguous copy."""
    return t if t.stride(-1) == 1 and (t.shape[-2] <= 1 or t.stride(-2) == t.shape[-1]) else t.contiguous()


def _mask_bias(mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """A 4D attention mask (B, 1, 1, kv) (boolean: True attends; or additive) -> (B, length) additive float32."""
    if mask is None:
        return None
    row = mask[:, 0, -1, :length]                                               # (B, L): the last query's row
    if row.dtype == torch.bool:
        return torch.zeros(row.shape, dtype=torch.float32).masked_fill_(~row, -math.inf)
    return row.float().contiguous()


def kvplay_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                     is_causal=None, **kwargs):
    """transformers' attention interface: the fused kernel for kvplay's placeholders, sdpa for everything else.

    query (B, Hq, q, D); key, value (B, Hkv, kv, D) -> ((B, q, Hq, D), None). A forward given the keyword
    kvplay_probe=f first calls f(layer index, query, key, value, scaling); where it returns an output, that
    is the layer's (fragile.py measures so how much each layer's stored keys cost the logits). Functions the
    keys carry in AFTER run afterwards with the queries.
    """
    after = getattr(key, AFTER, ())
    out = _attend(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    for f in after:                                    # an evicting cache scores its tokens by these queries
        f(query, scaling if scaling is not None else query.shape[-1] ** -0.5)
    return out


def _attend(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs):
    rows = getattr(key, "kvplay_rows", None)
    if rows is not None:                               # rows.RowGroups: each group over its own cache
        return _per_group(module, query, rows, attention_mask, dropout, scaling, is_causal, **kwargs), None
    probe = kwargs.pop("kvplay_probe", None)
    if probe is not None:
        out = probe(module.layer_idx, query, key, value, scaling if scaling is not None else query.shape[-1] ** -0.5)
        if out is not None:
            return out, None
    view = getattr(key, "kvplay_view", None)
    if view is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = None
    if dropout == 0 and query.shape[2] == 1 and not kwargs.get("output_attentions") \
            and all(kwargs.get(k) is None for k in _UNSUPPORTED):
        out = view.attend(query, attention_mask, scaling if scaling is not None else query.shape[-1] ** -0.5)
    if out is None:                                    # the kernel cannot: the dequantize path, same tensors
        key, value = view.materialize()
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    return out, None


def _per_group(module, query, rows, attention_mask, dropout, scaling, is_causal, **kwargs) -> torch.Tensor:
    """query (G * B, Hq, q, D) -> (G * B, q, Hq, D): group g's B rows attend over group g's keys and values."""
    b, outs = rows.rows, []
    for g, (key, value) in enumerate(rows.parts):                 # each (B, Hkv, kv, D), real or placeholders
        mask = attention_mask
        if mask is not None and mask.shape[0] > 1:
            mask = mask[g * b:(g + 1) * b]
        if mask is not None and mask.shape[-1] > key.shape[-2]:      # an evicting cache holds fewer tokens; the
            mask = mask[..., -key.shape[-2]:]                         # batch is unpadded, so its newest count
        out, _ = kvplay_attention(module, query[g * b:(g + 1) * b], key, value, mask, dropout=dropout,
                                  scaling=scaling, is_causal=is_causal, **kwargs)
        outs.append(out)                                          # (B, q, Hq, D)
    return torch.cat(outs)


AttentionInterface.register(NAME, kvplay_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)      # the same boolean masks sdpa gets (None when unpadded)
