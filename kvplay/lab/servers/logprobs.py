"""Prompt log-probabilities from /v1/completions echo responses, and KL from top-k of them.

scored(choice, prompt, name) reads OpenAI's legacy layout (vLLM, SGLang: entry i is p(token i | before), the
first None), llama-cpp-python's (on a model without BOS, entry i predicts token i + 1 and the generated token
is dropped: realigned here) and vLLM's `prompt_logprobs`. kl_topk is the approximation every server row's KL
uses; tests/test_servers.py bounds it against full distributions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvplay.errors import KvplayError


@dataclass
class Scored:
    """A text as one server read it: its tokens, and per token the distribution that predicted it."""

    tokens: list[str]
    offsets: list[int]                 # character offset of each token in the text
    top: list[dict | None]             # top-k {token string: logprob} that predicted token i (None: not given)
    logprob: list[float | None]        # log p(token i), None where the server did not give it
    # True: every token's own log-probability is given (OpenAI's layout). False: llama-cpp-python's echo, which
    # returns each token's log-probability under the next position's distribution; its own is known only where
    # it ranks in the top-k of the distribution that predicted it.
    exact: bool = True


def _no_logprobs(name: str) -> KvplayError:
    return KvplayError(f"Server {name!r} returned no prompt log-probabilities (it needs echo with logprobs on "
                       "/v1/completions, as vLLM, SGLang and llama-cpp-python serve; llama.cpp's llama-server "
                       "does not), so kvplay can compare its text but not its KL or perplexity.")


def _top_only(top: list, tokens: list, k: int) -> list:
    """Each entry's top-k alone. Servers add the entry's own token to its dict when it is not among the k (vLLM,
    llama-cpp-python): a true probability, but below the k-th, so kept it would pass for the bound on every
    unlisted token and pull that bound far down (llama-cpp-python, SmolLM2: perplexity 43.8 against 31.8)."""
    out = []
    for t, tok in zip(top, tokens):
        if isinstance(t, dict) and len(t) > k and tok in t:
            t = {key: v for key, v in t.items() if key != tok}
        out.append(t)
    return out


def scored(choice: dict, prompt: str, name: str, top_k: int | None = None) -> Scored:
    """The prompt's tokens and their top-k from an echo response (OpenAI's layout or llama-cpp-python's).
    top_k: the k asked for, so that an entry's own token beyond the k can be told apart (None: dicts as given)."""
    lp = choice.get("logprobs")
    if isinstance(lp, dict) and lp.get("top_logprobs") and lp.get("tokens"):
        tokens, top = list(lp["tokens"]), list(lp["top_logprobs"])
        if top_k:
            top = _top_only(top, tokens, top_k)
        values = list(lp.get("token_logprobs") or [None] * len(tokens))
        offsets = list(lp.get("text_offset") or [])
        if len(offsets) != len(tokens):
            offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        n = sum(1 for o in offsets if o < len(prompt))            # the prompt's tokens; the rest were generated
        if n == len(tokens):    # llama-cpp-python, no BOS: entry i predicts token i + 1, the generated one dropped
            top = [None] + top[:-1]
            values = [None] + [t.get(tok) if isinstance(t, dict) else None for t, tok in zip(top[1:], tokens[1:])]
        top = [{str(k): float(v) for k, v in t.items()} if isinstance(t, dict) else None for t in top[:n]]
        return Scored(tokens[:n], offsets[:n], top, [None if v is None else float(v) for v in values[:n]],
                      exact=n != len(tokens))
    prompt_lp = choice.get("prompt_logprobs")          # vLLM's extra parameter: [None, {id: {logprob, ...}}, ...]
    if isinstance(prompt_lp, list) and len(prompt_lp) > 1:
        top = [None] + [{str(v.get("decoded_token", k)): float(v["logprob"]) for k, v in e.items()}
                        if isinstance(e, dict) else None for e in prompt_lp[1:]]
        return Scored([""] * len(top), list(range(len(top))), top, [None] * len(top))
    raise _no_logprobs(name)


def kl_topk(p: dict, q: dict) -> float:
    """KL(p || q) in nats from two top-k {token: logprob} dicts: p's listed tokens and one bucket for the rest.

    A token of p's that q does not list gets at most q's smallest listed probability and an equal share of
    q's unlisted mass with the other missing tokens and the bucket. The bucket term compares the two tails'
    masses. Exact when both dicts hold the full vocabulary; tests/test_servers.py bounds the error at k = 20.
    """
    qp = {t: math.exp(v) for t, v in q.items()}
    q_tail = max(1.0 - sum(qp.values()), 1e-12)
    missing = sum(1 for t in p if t not in qp)     # they share q's unlisted mass with the bucket
    q_floor = min(min(qp.values(), default=q_tail), q_tail / (missing + 1))
    kl, p_mass, q_mass = 0.0, 0.0, 0.0
    for t, lp in p.items():
        pi = math.exp(lp)
        qi = qp.get(t, q_floor)
        kl += pi * (lp - math.log(qi))
        p_mass, q_mass = p_mass + pi, q_mass + qi
    p_rest, q_rest = max(1.0 - p_mass, 0.0), max(1.0 - q_mass, 1e-12)
    if p_rest > 1e-12:
        kl += p_rest * math.log(p_rest / q_rest)
    return max(kl, 0.0)


def _argmax(d: dict | None) -> str | None:
    return max(d, key=d.get) if d else None


class _Ids:
    """kvplay's own ids for token strings, shared by every row of one run (the API returns no ids)."""

    def __init__(self):
        self.ids: dict[str, int] = {}

    def __call__(self, token: str) -> int:
        return self.ids.setdefault(token, len(self.ids))


def _generated_tokens(choice: dict, name: str) -> list[str]:
    """The generated tokens' strings (OpenAI's legacy logprobs, or llama.cpp's `content` list)."""
    lp = choice.get("logprobs")
    if isinstance(lp, dict) and isinstance(lp.get("tokens"), list):
        return [str(t) for t in lp["tokens"]]
    if isinstance(lp, dict) and isinstance(lp.get("content"), list):
        return [str(e.get("token", "")) for e in lp["content"] if isinstance(e, dict)]
    raise _no_logprobs(name)
