"""`reap serve`: open the streaming engine on a checkpoint and serve it over the OpenAI API
(`reap.serve.http`) until interrupted.

    reap serve [MODEL] --port 8000 --budget 8GB

Ctrl-C (SIGINT) or SIGTERM stops it whatever the clients are doing (`STOP`, in --help).
"""

from __future__ import annotations

import argparse
import sys

from reap.errors import ReapError, on_interrupt

STOP_SECONDS = 10  # the longest a stop may take before the process exits regardless
STOP = ("Ctrl-C (SIGINT) or SIGTERM stops it whatever the clients are doing: it stops accepting,"
        "\ncancels the running generation, answers queued requests 503 and exits 5 within "
        f"{STOP_SECONDS} s.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of `reap serve`."""
    from reap.engine.cli import RESIDENT_HELP
    from reap.engine.memory import PRESET_HELP, PRESETS

    p.description += "\n\n" + STOP
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
    p.add_argument("--resident-from", metavar="STATS", help=RESIDENT_HELP)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--verbose", action="store_true", help="log every HTTP request")
    add_limit_arguments(p)


def add_limit_arguments(p: argparse.ArgumentParser) -> None:
    """The bounds that keep one client from taking a shared machine (`Limits`)."""
    from reap.serve.limits import BODY_BOUNDS, BODY_BYTES_PER_CHAR, CHARS_PER_TOKEN, Limits

    d = Limits()
    g = p.add_argument_group("access and limits (each bounded by default)")
    g.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="a Host name clients may address besides the loopback names and --host "
                        "(repeatable; '*' = any). Other Host or browser Origin headers are "
                        "refused (403), against DNS rebinding and cross-site pages")
    g.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="connections served at once, one thread each; more are answered 503 "
                        f"(default {d.max_connections})")
    g.add_argument("--read-timeout", type=float, default=d.read_timeout,
                   help="seconds a client has to send one whole request, idle keep-alive "
                        f"included; slower ones are dropped (default {d.read_timeout:g})")
    g.add_argument("--max-body", type=int, default=None,
                   help=f"largest request body in bytes (default {BODY_BYTES_PER_CHAR} per "
                        f"prompt character, within {BODY_BOUNDS[0] >> 20}-{BODY_BOUNDS[1] >> 20} "
                        "MiB: 1 MiB at --context 4096)")
    g.add_argument("--max-prompt-chars", type=int, default=None,
                   help="longest prompt in characters, refused before tokenizing (default "
                        f"{CHARS_PER_TOKEN} x --context)")
    g.add_argument("--backlog", type=int, default=d.backlog,
                   help=f"listen backlog: connections queued before accept (default {d.backlog})")


def limits_of(args: argparse.Namespace):
    """The `Limits` the command line asks for."""
    from reap.serve.limits import Limits

    return Limits(args.max_connections, args.read_timeout, args.max_body, args.max_prompt_chars,
                  args.backlog)


def run(args: argparse.Namespace) -> int:
    """`reap serve`: open the engine, then serve until interrupted."""
    from reap.engine.cli import set_threads
    from reap.serve.backend import open_backend
    from reap.serve.hosts import check_host
    from reap.serve.http import Server

    on_interrupt(STOP_SECONDS)  # from the start: a signal while the engine loads exits 5 too
    check_host(args.host, args.allow_remote)  # refuse before loading anything
    limits = limits_of(args)
    limits.check()
    if args.queue < 1 or args.max_tokens_limit < 1:
        raise ReapError("--queue and --max-tokens-limit must be at least 1")
    set_threads(args.threads)
    backend = open_backend(args.model, args.served_name, budget=args.budget,
                           preset=args.preset, context=args.context, device=args.device,
                           dtype=args.dtype, max_generation=args.max_tokens_limit,
                           resident_from=args.resident_from)
    print(backend.engine.plan.describe(), file=sys.stderr)
    try:
        server = Server(backend, args.host, args.port, args.queue, args.max_tokens_limit,
                        args.allow_remote, args.verbose, limits, tuple(args.allowed_host))
    except ReapError:
        backend.close()
        raise
    print(f"reap serve: {backend.model_id} at {server.url} (Ctrl-C stops)", file=sys.stderr,
          flush=True)
    try:
        server.httpd.serve_forever()  # in this thread, until Ctrl-C or SIGTERM (exit 5)
    finally:
        server.stop()
    return 0

