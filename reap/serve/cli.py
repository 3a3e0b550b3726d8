"""`reap serve`: open the streaming engine on a checkpoint and serve it over the OpenAI API
(`reap.serve.http`) until interrupted.

    reap serve [MODEL] --port 8000 --budget 8GB
"""

from __future__ import annotations

import argparse
import sys

from reap.errors import ReapError


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of `reap serve`."""
    from reap.engine.memory import PRESET_HELP, PRESETS

    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory or http(s) URL of one (fetched on demand into "
                        "~/.cache/reap/http); default: the bundled default model")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 = any)")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow a non-loopback --host (the server has no authentication)")
    p.add_argument("--served-name", help="model id clients use (default: the MODEL's name)")
    p.add_argument("--queue", type=int, default=16, help="requests that may wait (default 16)")
    mem = p.add_mutually_exclusive_group()
    mem.add_argument("--budget", help="RAM budget, e.g. 8GB (the whole process)")
    mem.add_argument("--preset", choices=list(PRESETS), help=PRESET_HELP)
    p.add_argument("--context", type=int, default=4096, help="prompt + generated tokens (4096)")
    p.add_argument("--max-tokens-limit", type=int, default=4096, help="largest max_tokens (4096)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--verbose", action="store_true", help="log every HTTP request")


def run(args: argparse.Namespace) -> int:
    """`reap serve`: open the engine, then serve until interrupted."""
    from reap.serve.backend import open_backend
    from reap.serve.http import Server, check_host

    check_host(args.host, args.allow_remote)  # refuse before loading anything
    if args.queue < 1 or args.max_tokens_limit < 1 or (args.threads or 1) < 1:
        raise ReapError("--queue, --max-tokens-limit and --threads must be at least 1")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    backend = open_backend(args.model, args.served_name, budget=args.budget,
                           preset=args.preset, context=args.context, device=args.device,
                           dtype=args.dtype, max_generation=args.max_tokens_limit)
    print(backend.engine.plan.describe(), file=sys.stderr)
    try:
        server = Server(backend, args.host, args.port, args.queue, args.max_tokens_limit,
                        args.allow_remote, args.verbose)
    except ReapError:
        backend.close()
        raise
    print(f"reap serve: {backend.model_id} at {server.url} (Ctrl-C stops)", file=sys.stderr,
          flush=True)
    try:
        server.httpd.serve_forever()  # in this thread, until Ctrl-C (exit 5)
    finally:
        server.stop()
    return 0
