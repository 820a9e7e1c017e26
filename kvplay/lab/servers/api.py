"""Servers as kvplay sees them: NAME=URL specs, the operator's allowlist, and a bounded JSON client.

parse_server('q4:q4_0=http://127.0.0.1:8001') -> Server; resolve(items, settings, allow_urls=...) refuses a URL
unless allowed (a hosted app never allows one: only names from Settings.servers, KVPLAY_SERVERS). Client sends
/v1 requests with a timeout, two retries on connection errors and 502/503/504, and bounded request and response
sizes. kvplay.lab.servers (the package) runs the measurements; docs/servers.md explains them.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvplay.cache import parse_spec
from kvplay.cache.methods.server import TYPE_BITS, valid_name
from kvplay.errors import KvplayError

PREFIX = "server"
TOP_K = 20                   # vLLM's default --max-logprobs is 20; OpenAI's legacy API allowed 5
MAX_REQUEST_BYTES = 4 << 20  # a prompt or text past this is refused before it is sent
MAX_RESPONSE_BYTES = 64 << 20   # echo with top-20 is ~1.5 KB a token: 64 MiB covers ~40k tokens
TIMEOUT_S = 300.0            # one request, read timeout (a long text's prefill on a busy server)
CONNECT_S = 5.0
RETRIES = 2                  # on connection errors and 502/503/504, after 0.5 s then 1 s
# Plain greedy decoding: llama-cpp-python's server applies repeat_penalty 1.1 unless told otherwise, and vLLM and
# SGLang take repetition_penalty; each engine ignores the other's name.
GREEDY = {"temperature": 0.0, "top_p": 1.0, "seed": 0, "repeat_penalty": 1.0, "repetition_penalty": 1.0}


@dataclass(frozen=True)
class Server:
    name: str
    url: str
    kv: str | None = None          # the cache type the user says it runs, for the bytes; None: not given

    @property
    def spec(self):
        """Its row's CacheSpec (kvplay/cache/methods/server.py): `server:NAME`."""
        return parse_spec(f"{PREFIX}:{self.name}")

    @property
    def bits(self) -> float | None:
        return TYPE_BITS.get(self.kv) if self.kv else None


def _check_url(url: str, name: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise KvplayError(f"Server {name!r} needs an http:// or https:// URL, not {url[:60]!r}.")
    if parts.query or parts.fragment:
        raise KvplayError(f"Server {name!r}: give the server's base URL, without a query or fragment.")
    base = url.rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


def parse_server(text: str) -> Server:
    """'NAME=URL' or 'NAME:TYPE=URL' -> Server, or one sentence."""
    if not isinstance(text, str) or "=" not in text:
        raise KvplayError(f"A server looks like NAME=URL (e.g. q4=http://127.0.0.1:8001), not {str(text)[:60]!r}.")
    label, _, url = (p.strip() for p in text.partition("="))
    name, _, kv = (p.strip() for p in label.partition(":"))
    kv = kv.lower() or (name.lower() if name.lower() in TYPE_BITS else "")
    if not valid_name(name):
        raise KvplayError(f"A server's name is letters, digits, '-', '_' or '.', not {name[:40]!r}.")
    if kv and kv not in TYPE_BITS:
        raise KvplayError(f"Unknown cache type {kv!r} for server {name!r}; choose one of {', '.join(TYPE_BITS)}.")
    return Server(name=name, url=_check_url(url, name), kv=kv or None)


def allowlist(settings) -> dict[str, Server]:
    """The operator's servers (Settings.servers, KVPLAY_SERVERS), by name."""
    servers = [parse_server(item) for item in getattr(settings, "servers", ())]
    return {s.name: s for s in servers}


def resolve(items, settings, *, allow_urls: bool) -> list[Server]:
    """Servers from 'NAME=URL' items (only when allow_urls) or bare names from the allowlist; two or more."""
    if isinstance(items, str):
        items = items.split()
    known, out = allowlist(settings), []
    for item in items or []:
        if not isinstance(item, str):
            raise KvplayError("Servers must be given as NAME=URL strings.")
        if "=" in item:
            if not allow_urls:
                raise KvplayError("This app measures only the servers its operator lists in KVPLAY_SERVERS; "
                                  f"choose one of: {', '.join(known) or 'none are listed'}.")
            out.append(parse_server(item))
        elif item.strip() in known:
            out.append(known[item.strip()])
        else:
            raise KvplayError(f"Unknown server {item[:40]!r}: give NAME=URL, or one of KVPLAY_SERVERS' names "
                              f"({', '.join(known) or 'none are listed'}).")
    if len(out) < 2:
        raise KvplayError("Name two or more servers of the same model: the 16-bit reference first, then each "
                          "quantized cache.")
    if len({s.name for s in out}) < len(out):
        raise KvplayError("Each server needs its own name.")
    return out


class Client:
    """One server's /v1 API: bounded JSON over httpx, with timeouts and retries."""

    def __init__(self, server: Server, timeout: float = TIMEOUT_S, retries: int = RETRIES):
        import httpx  # httpx: loaded only when a server is compared

        self.server, self.retries = server, retries
        self.http = httpx.Client(base_url=server.url, timeout=httpx.Timeout(timeout, connect=CONNECT_S),
                                 follow_redirects=False, trust_env=False)

    def close(self) -> None:
        self.http.close()

    def request(self, method: str, path: str, body: dict | None = None) -> dict:
        import httpx  # httpx: loaded only when a server is compared

        data = json.dumps(body).encode() if body is not None else None
        if data is not None and len(data) > MAX_REQUEST_BYTES:
            raise KvplayError(f"The request to server {self.server.name!r} is {len(data) >> 20} MiB, over the "
                              f"{MAX_REQUEST_BYTES >> 20} MiB bound: use a shorter text.")
        name = self.server.name
        for attempt in range(self.retries + 1):
            try:
                with self.http.stream(method, path, content=data,
                                      headers={"Content-Type": "application/json"}) as r:
                    if r.status_code in (502, 503, 504) and attempt < self.retries:
                        time.sleep(0.5 * 2 ** attempt)
                        continue
                    raw = bytearray()
                    for part in r.iter_bytes():
                        raw += part
                        if len(raw) > MAX_RESPONSE_BYTES:
                            raise KvplayError(f"Server {name!r} sent more than {MAX_RESPONSE_BYTES >> 20} MiB; "
                                              "kvplay stopped reading (use a shorter text or a smaller top-k).")
                    status = r.status_code
            except (httpx.ConnectError, httpx.RemoteProtocolError) as exc:
                if attempt < self.retries:
                    time.sleep(0.5 * 2 ** attempt)
                    continue
                raise KvplayError(f"Cannot reach server {name!r} at {self.server.url}: {exc}.") from None
            except httpx.TimeoutException:
                raise KvplayError(f"Server {name!r} did not answer {path} within {TIMEOUT_S:.0f} s.") from None
            except httpx.HTTPError as exc:
                raise KvplayError(f"Server {name!r} failed on {path}: {exc}.") from None
            break
        text = raw.decode("utf-8", errors="replace")
        if status != 200:
            raise KvplayError(f"Server {name!r} answered {path} with HTTP {status}: {text[:200].strip()}")
        try:
            return json.loads(text)
        except ValueError:
            raise KvplayError(f"Server {name!r} answered {path} with something other than JSON.") from None

    def model(self) -> str:
        data = self.request("GET", "/v1/models").get("data") or []
        if not data or not isinstance(data[0], dict) or "id" not in data[0]:
            raise KvplayError(f"Server {self.server.name!r} lists no model at /v1/models.")
        return str(data[0]["id"])

    def complete(self, model: str, prompt: str, max_tokens: int, *, echo: bool = False,
                 logprobs: int | None = None) -> tuple[dict, float]:
        """One greedy /v1/completions request -> (its first choice, with `usage` and `timings`, wall seconds)."""
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "echo": echo, "stream": False, **GREEDY}
        if logprobs is not None:
            body["logprobs"] = logprobs
        t0 = time.perf_counter()
        out = self.request("POST", "/v1/completions", body)
        wall = time.perf_counter() - t0
        choices = out.get("choices") or []
        if not choices or not isinstance(choices[0], dict):
            raise KvplayError(f"Server {self.server.name!r} returned no completion.")
        return {**choices[0], "usage": out.get("usage") or {}, "timings": out.get("timings") or {}}, wall
