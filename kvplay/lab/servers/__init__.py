"""Running OpenAI-compatible servers as caches: a deployment's quantized KV cache against its 16-bit twin.

    servers = resolve(["base=http://127.0.0.1:8000", "q4:q4_0=http://127.0.0.1:8001"], settings, allow_urls=True)
    result = compare(servers, "Summarise: ...", 64)        # CompareResult, the first server is the reference
    result = ppl(servers, text, max_tokens=1024)           # PplResult

A server is `NAME=URL` or `NAME:TYPE=URL`; TYPE (f16, bf16, q8_0, q4_0, ..., fp8) is the cache type the user
started it with, using the engine's own flags (vLLM --kv-cache-dtype, llama.cpp --type_k/--type_v); it only
gives the rows their bytes per element, since no engine reports it. A NAME that is itself a type counts as
one (`q4_0=URL`). Every server must serve the same model (/v1/models); the first is the reference.

What is measured, through POST /v1/completions only (docs/servers.md lists what each engine serves):
- greedy text (temperature 0) and its first divergence from the reference, compared as token strings (the API
  returns no ids: token_ids are kvplay's own numbering of the servers' token strings, shared by every row);
- teacher-forced KL and top-1 on the prompt plus the reference's text, and perplexity on a text, from the
  prompt log-probabilities the server echoes (`echo` + `logprobs`: vLLM, SGLang, llama-cpp-python). Only the
  top-k are returned, so KL is an approximation (kl_topk; tests/test_servers.py bounds it against full
  distributions); top-1 is exact. llama-cpp-python's echo on a model without BOS lists each distribution one
  token early and drops the last (entry i predicts token i+1); kvplay detects that layout and realigns it;
- decode tokens/s from the server's `timings` when it reports them (llama.cpp's server), otherwise from two
  requests' wall times over HTTP, (n - 1) tokens / (time of n tokens - time of 1).

RUNNER is the hook of the `server` method (kvplay/cache/methods/server.py names this package as its runner):
kvplay.lab.engines.compare_alone("server", items, ...) resolves the items and compares the servers, so the app
reaches them without importing this package.

Safety: a hosted app resolves only names in the operator's allowlist (Settings.servers, KVPLAY_SERVERS);
a URL typed by a visitor is refused (allow_urls=False). Requests carry a timeout, retry twice on connection
errors and 502/503/504, and both the request body and the response are bounded. URLs never enter results.
"""
from __future__ import annotations

import json
import math
import time

from kvplay.errors import KvplayError
from kvplay.lab.engines import EngineRunner
from kvplay.lab.generate import speed_stats
from kvplay.lab.metrics import divergence
from kvplay.lab.servers.api import (  # noqa: F401
    GREEDY,
    PREFIX,
    TOP_K,
    TYPE_BITS,
    Client,
    Server,
    parse_server,
    resolve,
)
from kvplay.lab.servers.logprobs import Scored, _argmax, _generated_tokens, _Ids, kl_topk, scored
from kvplay.results import CacheRun, CompareResult, Environment, PplResult, PplRun
from kvplay.results.compare import label_for

KL_WINDOW = 64
APPROX_NOTE = ("KL from the servers' top-{k} log-probabilities is an approximation (tokens outside a server's "
               "top-k are estimated); top-1 and the text comparison are exact.")


def _stream_timing(client: Client, model: str, prompt: str, max_tokens: int) -> tuple[float, list[float]]:
    """(seconds to the first streamed token, seconds between later tokens) of one greedy streamed request."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, **GREEDY}
    import httpx  # httpx: loaded only when a server is compared

    arrivals, t0 = [], time.perf_counter()
    try:
        with client.http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return 0.0, []
            for line in r.iter_lines():
                if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                    try:
                        chunk = json.loads(line[5:])
                    except ValueError:
                        continue
                    if any((c.get("text") or "") for c in chunk.get("choices") or [] if isinstance(c, dict)):
                        arrivals.append(time.perf_counter())
                if len(arrivals) > max_tokens + 1:
                    break
    except httpx.HTTPError:
        return 0.0, []
    if not arrivals:
        return 0.0, []
    return arrivals[0] - t0, [b - a for a, b in zip(arrivals, arrivals[1:])]


def _clients(servers: list[Server]) -> tuple[list[Client], str]:
    clients = [Client(s) for s in servers]
    models = [c.model() for c in clients]
    if len(set(models)) > 1:
        for c in clients:
            c.close()
        pairs = ", ".join(f"{s.name}: {m}" for s, m in zip(servers, models))
        raise KvplayError(f"The servers serve different models ({pairs}); kvplay compares one model's caches.")
    return clients, models[0]


def _env(servers: list[Server], model: str) -> Environment:
    return Environment(model=model, dtype="as served", device="servers: " + ", ".join(s.name for s in servers))


def _floor(top: dict | None) -> float:
    return min(top.values()) if top else 0.0


def compare(servers: list[Server], prompt: str, max_new_tokens: int, *, top_k: int = TOP_K,
            progress=None) -> CompareResult:
    """Greedy text on each server, then every server reads prompt + the reference's text teacher-forced."""
    if not isinstance(prompt, str) or not prompt:
        raise KvplayError("Give a prompt for the servers.")
    progress = progress or (lambda f, d: None)
    clients, model = _clients(servers)
    ids, rows, forced = _Ids(), [], None
    try:
        steps = 3 * len(servers)
        for i, (server, client) in enumerate(zip(servers, clients)):
            progress(i / steps, f"{server.name}: timing")
            t0 = time.perf_counter()
            first_s, gaps = _stream_timing(client, model, prompt, max_new_tokens)
            progress((i + 0.5) / steps, f"{server.name}: generating")
            gen, _ = client.complete(model, prompt, max_new_tokens, logprobs=min(top_k, 5))
            rows.append((server, gen, _generated_tokens(gen, server.name), first_s, gaps, time.perf_counter() - t0))
        base_text = rows[0][1].get("text") or ""
        full = prompt + base_text
        for i, (server, client) in enumerate(zip(servers, clients)):
            progress((len(servers) + 2 * i) / steps, f"{server.name}: teacher forcing")
            choice, _ = client.complete(model, full, 1, echo=True, logprobs=top_k)
            s = scored(choice, full, server.name, top_k)
            keep = [j for j, o in enumerate(s.offsets) if o >= len(prompt)]
            forced = forced or (s, keep)
            if len(keep) != len(forced[1]) or [s.tokens[j] for j in keep] != [forced[0].tokens[j] for j in forced[1]]:
                raise KvplayError(f"Server {server.name!r} tokenizes the text differently from "
                                  f"{servers[0].name!r}: are they serving the same model?")
            rows[i] = rows[i] + ((s, keep),)
    finally:
        for c in clients:
            c.close()
    p, keep = forced
    base_ids = [ids(t) for t in rows[0][2]]
    base_bits = servers[0].bits or 16.0
    runs = []
    for server, gen, tokens, first_s, gaps, wall, (q, _) in rows:
        steps_p = [p.top[j] for j in keep]
        steps_q = [q.top[j] for j in keep]
        kl = [round(kl_topk(a, b), 6) if a and b else 0.0 for a, b in zip(steps_p, steps_q)]
        top1 = [_argmax(a) == _argmax(b) for a, b in zip(steps_p, steps_q)]
        logprob = [round(q.logprob[j] if q.logprob[j] is not None else _floor(q.top[j]), 5) for j in keep]
        tok_ids = [ids(t) for t in tokens]
        first, frac, spans = divergence(base_ids, tok_ids)
        timed = (gen.get("timings") or {}).get("predicted_per_second")
        speed, spread, n_timed = speed_stats([0.0] + gaps, 1) if gaps else (0.0, [], 0)
        how = "from the stream's token arrivals over HTTP"
        if timed:
            speed, spread, how = float(timed), [], "as the server reports it (timings.predicted_per_second)"
        prompt_tokens = int((gen.get("usage") or {}).get("prompt_tokens") or 0)
        context = [prompt_tokens + k for k in range(len(tokens))] or [prompt_tokens]
        bits = server.bits or 16.0
        top5 = [sorted(t.items(), key=lambda kv: -kv[1])[:5] if t else [] for t in steps_q]
        kv = f"{server.kv} cache" if server.kv else "cache type not given (NAME:TYPE=URL gives its bytes)"
        runs.append(CacheRun(
            spec=str(server.spec), text=gen.get("text") or "", token_ids=tok_ids, tokens=tokens, first_divergence=first,
            match_fraction=frac, diff_spans=[list(s) for s in spans], kl=kl, top1=top1, baseline_logprob=logprob,
            mean_kl=sum(kl) / max(len(kl), 1), max_kl=max(kl, default=0.0),
            top1_agreement=sum(top1) / max(len(top1), 1), context_tokens=context,
            cache_bytes_per_step=[0] * len(context), cache_bytes=0, baseline_bytes=0, compression=base_bits / bits,
            bits_per_element=bits, prefill_s=first_s,
            prefill_tokens_per_s=prompt_tokens / first_s if first_s > 0 else 0.0, decode_tokens_per_s=speed,
            wall_s=wall, decode_timed_steps=n_timed, decode_spread=spread,
            speed_note="" if speed else "the server streamed no tokens to time",
            description=(f"server {server.name} ({model}), {kv}; speed {how}; " + APPROX_NOTE.format(k=top_k)),
            top5_ids=[[ids(t) for t, _ in s] for s in top5], top5_probs=[[round(math.exp(v), 5) for _, v in s]
                                                                        for s in top5],
            top5_tokens=[[t for t, _ in s] for s in top5], label=label_for(server.spec, max_new_tokens)))
    progress(1.0, "servers: done")
    return CompareResult(prompt=prompt, prompt_tokens=runs[0].context_tokens[0], max_new_tokens=max_new_tokens,
                         batch_size=1, sampling={"temperature": 0.0, "top_k_logprobs": top_k},
                         env=_env(servers, model), caches=runs)


def _cut(client: Client, model: str, text: str, max_tokens: int, top_k: int, name: str) -> tuple[str, Scored | None]:
    """The text cut to at most max_tokens of the server's tokens, and the server's reading of it (None: cut)."""
    cut = text[:max_tokens * 3]                      # ~4 characters a token in English: under the limit first
    for _ in range(3):
        choice, _ = client.complete(model, cut, 1, echo=True, logprobs=top_k)
        s = scored(choice, cut, name, top_k)
        n = len(s.tokens)
        if n > max_tokens:                           # cut at a token boundary: the reference reads it again
            return cut[:s.offsets[max_tokens]], None
        if len(cut) >= len(text) or n >= 0.97 * max_tokens:
            return cut, s
        cut = text[:int(len(cut) * 0.97 * max_tokens / max(n, 1))]
    return cut, s


def ppl(servers: list[Server], text: str, *, max_tokens: int = 2048, top_k: int = TOP_K, text_name: str = "",
        progress=None) -> PplResult:
    """Perplexity, KL and top-1 over a text each server reads once (echo), against the first server's."""
    if not isinstance(text, str) or not text.strip():
        raise KvplayError("Give a text for the servers to read.")
    progress = progress or (lambda f, d: None)
    clients, model = _clients(servers)
    try:
        progress(0.0, f"{servers[0].name}: fitting the text")
        text, first = _cut(clients[0], model, text, max_tokens, top_k, servers[0].name)
        reads = [first] if first is not None else []
        for i, (server, client) in enumerate(zip(servers[len(reads):], clients[len(reads):]), len(reads)):
            progress(i / len(servers), f"{server.name}: reading")
            choice, _ = client.complete(model, text, 1, echo=True, logprobs=top_k)
            reads.append(scored(choice, text, server.name, top_k))
    finally:
        for c in clients:
            c.close()
    if any(r.tokens != reads[0].tokens for r in reads if r.tokens[0] or len(r.tokens) > 1):
        raise KvplayError("The servers tokenize the text differently: are they serving the same model?")
    n = min(len(r.top) for r in reads)
    keep = [j for j in range(n) if all(r.top[j] for r in reads)]          # positions every server scored
    exact = all(r.exact for r in reads)
    # Perplexity only where every server gave the token's own log-probability (all of them, but for
    # llama-cpp-python's echo); KL and top-1 wherever every server gave its top-k.
    ranked = keep if exact else [j for j in keep if all(r.logprob[j] is not None for r in reads)]
    if len(ranked) < 16:
        raise KvplayError(f"The servers scored only {len(ranked)} tokens of the text; give a longer text.")
    p, runs, base_ppl = reads[0], [], None
    for server, q in zip(servers, reads):
        lps = [q.logprob[j] if q.logprob[j] is not None else _floor(q.top[j]) for j in ranked]
        value = math.exp(-sum(lps) / len(lps))
        base_ppl = base_ppl or value
        kl = [kl_topk(p.top[j], q.top[j]) for j in keep]
        top1 = [_argmax(p.top[j]) == _argmax(q.top[j]) for j in keep]
        runs.append(PplRun(spec=str(server.spec), ppl=value, delta_ppl_pct=100 * (value / base_ppl - 1),
                           mean_kl=sum(kl) / len(kl), top1_agreement=sum(top1) / len(top1),
                           kl_along_text=[sum(kl[i:i + KL_WINDOW]) / len(kl[i:i + KL_WINDOW])
                                          for i in range(0, len(kl), KL_WINDOW)],
                           layer_key_error=[], layer_value_error=[]))    # a server does not hand its K/V back
    progress(1.0, "servers: done")
    name = f"{text_name or 'text'}, {len(keep)} tokens scored by the servers (top-{top_k}: KL approximate)"
    if not exact:
        name += (f"; perplexity over the {len(ranked)} of {len(keep)} tokens every server ranked in its top-{top_k} "
                 "(llama-cpp-python's echo gives no other token its own log-probability)")
    return PplResult(text_name=name, tokens=len(reads[0].tokens), chunk=0, env=_env(servers, model), caches=runs)


class ServersRunner(EngineRunner):
    """Running servers' hook (kvplay.lab.engines): compared with each other, never beside a model's own caches
    (the server method's check refuses that first)."""

    def compare_alone(self, targets, prompt, max_new_tokens, *, settings, progress):
        """`targets`: NAME=URL items where settings.allow_server_urls, else names from KVPLAY_SERVERS only."""
        chosen = resolve(targets, settings, allow_urls=settings.allow_server_urls)
        return compare(chosen, prompt, max_new_tokens, progress=progress)


RUNNER = ServersRunner()
