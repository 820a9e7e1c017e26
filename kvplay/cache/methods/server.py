"""A running OpenAI-compatible server as a cache method: `server:NAME` names one row of a servers' Compare.

    parse_spec("server:q4")           # the server the operator listed, or the user gave, as q4=URL

A server's cache is whatever its own flags set (vLLM --kv-cache-dtype, llama-server -ctk/-ctv), so the spec holds
only its name; the URL never enters a spec or a result. Its caches are not transformers caches (engine =
"server"): its runner, kvplay.lab.servers, measures the servers against the first one, and this module gives each
row what the rest of kvplay asks of a spec: its canonical text, a check that refuses it in a model's own Compare, its
bits per element from the cache type the user named, and the request that reproduces the row.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvplay.cache import ggml
from kvplay.cache.methods.base import CacheMethod, Scheme, option, register
from kvplay.errors import KvplayError

# Bits per cached element of the types a user can name: 16-bit and fp8 names, and llama.cpp's (ggml's blocks).
TYPE_BITS = {"f16": 16.0, "bf16": 16.0, "fp16": 16.0, "auto": 16.0, "fp8": 8.0, "fp8_e4m3": 8.0, "fp8_e5m2": 8.0,
             **{t: ggml.bits_per_element(t) for t in ggml.TYPES if ggml.quantized(t)}}


@dataclass(frozen=True)
class ServerOptions:
    name: str = option("", label="server name", help="the name the server was given (NAME=URL or KVPLAY_SERVERS)")


def valid_name(name: str) -> bool:
    return bool(name) and all(c.isalnum() or c in "-_." for c in name)


class Server(CacheMethod):
    name = "server"
    engine = "server"
    runner = "kvplay.lab.servers"       # its RUNNER compares servers with each other (compare_alone)
    order = 80
    advanced = False
    family = "running servers"
    colour_family, colour_offset, line_dash, marker = "slate", 2, "dot", "square"
    description = "a running OpenAI-compatible server (vLLM, SGLang, llama.cpp's server), measured against another"
    Options = ServerOptions
    schemes = (Scheme("server", "server", 16, "a running server, named as the user or the operator listed it"),)

    def shorthand(self, value: str, text: str) -> dict | None:
        name = value.strip()                  # names keep their case: `server:Q4` is Q4's row
        if not valid_name(name):
            raise KvplayError(f"A server's name is letters, digits, '-', '_' or '.', not {name[:40]!r}.")
        return {"name": name}

    def spec_text(self, spec) -> str:
        return f"{self.name}:{spec.options.name}" if spec.options.name else self.name

    def check_model(self, spec, config) -> None:
        raise KvplayError(f"{spec} is a running server: compare servers with each other (python -m kvplay compare "
                          "--server NAME=URL ..., or the Running servers panel), not with a model's own caches.")

    def engine_name(self, spec) -> str | None:
        return None

    def snippet(self, spec, max_new_tokens=64, load="") -> str:
        """The request that reproduces a server's row: the server's own flags set its cache."""
        return ("import httpx\n"
                f"# {spec.options.name}: the server you started, e.g. vLLM --kv-cache-dtype fp8 or "
                "llama-server -ctk q4_0 -ctv q4_0\n"
                "out = httpx.post(URL + \"/v1/completions\", json={\"model\": MODEL, \"prompt\": PROMPT, "
                f"\"max_tokens\": {max_new_tokens},\n"
                "                                            \"temperature\": 0.0, \"logprobs\": 5}).json()\n")


METHOD = register(Server())
