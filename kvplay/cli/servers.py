"""`compare --server ...` and `ppl --server ...`: running OpenAI-compatible servers as the caches
(kvplay.lab.servers; docs/servers.md)."""
from __future__ import annotations

from kvplay.app import prompts
from kvplay.app.checks import read_text_file
from kvplay.errors import KvplayError
from kvplay.lab import servers
from kvplay.lab.texts import HELD_OUT_TEXT
from kvplay.show.cards import verdict_text

SERVER_HELP = ("a running OpenAI-compatible server as a cache, NAME=URL or NAME:TYPE=URL (TYPE: its cache type, "
               "for the bytes); give two or more, the 16-bit reference first; --caches and --model are then unused "
               "(docs/servers.md)")


def run(args, progress, settings) -> list:
    """Resolve the servers (the CLI may name URLs), run, print the verdict and the note on KL."""
    chosen = servers.resolve(args.server, settings, allow_urls=True)
    k = servers.TOP_K
    if args.command == "compare":
        if args.temperature or args.batch_size != 1:
            raise KvplayError("Servers are compared greedy at batch size 1; leave --temperature and --batch-size.")
        if not 1 <= args.max_new_tokens <= 4096:
            raise KvplayError("--max-new-tokens must be between 1 and 4096 for servers.")
        result = servers.compare(chosen, args.prompt or prompts.raw_default_prompt(), args.max_new_tokens, top_k=k,
                                 progress=progress)
        print(verdict_text(result))
    else:
        text = read_text_file(args.text) if args.text else HELD_OUT_TEXT.read_text(encoding="utf-8")
        if not 16 <= args.max_tokens <= 1_000_000:
            raise KvplayError("--max-tokens must be 16 or more.")
        result = servers.ppl(chosen, text, max_tokens=args.max_tokens, top_k=k,
                             text_name=args.text.name if args.text else HELD_OUT_TEXT.name, progress=progress)
    print(servers.APPROX_NOTE.format(k=k))
    return [result]
