"""Abuse load on `reap serve` -> reports/reliability-server.md.

    python experiments/fuzz_server.py [--seed 0] [--count 300] [--time-limit 180]
        [--read-timeout 1] [--max-connections 16] [--out reports/reliability-server.md]

Starts the server in this process on 127.0.0.1 (an ephemeral port; nothing else is contacted)
over a fake backend that echoes bytes, then fires `--count` seeded probes, one after another
(a flood is one probe: 32-48 concurrent clients x 3 requests on a kept-alive connection each),
stopping early at `--time-limit` seconds. Kinds: bad Content-Length values, bounded and malformed chunked bodies,
slowloris (headers trickled forever), idle connections, floods, methods other than GET/POST,
foreign Host/Origin or non-JSON bodies, random garbage request lines, JSON that breaks parsers
(deep nesting, 300k objects, a 5000-digit integer, bad UTF-8, not an object), huge prompts, and
valid requests as a control. Each connection's outcome is one of:

- clean: a complete answer with a JSON body in OpenAI's error shape (or a 2xx result where the
  request was valid; HEAD answers carry headers only), or for an idle connection a close;
- accepted: an abusive request (bad length or framing, foreign Host/Origin, non-JSON body,
  oversized prompt, bad method, garbage, bad JSON) answered 2xx as if it were fine;
- internal: a 5xx other than 503, a non-JSON or HTML answer, a close without any answer to a
  request, or an exception in a server handler;
- hang: no answer and no close within read timeout + 5 s;
- reset: the connection was reset or refused.

Run with `PYTHONPATH=<a checkout>` to fuzz that checkout's server (the limit flags are applied
only where its `Server` accepts them).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import resource
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path

KINDS = ("length", "chunked", "slowloris", "idle", "flood", "method", "host", "garbage",
         "json_bomb", "huge_prompt", "valid")
OUTCOMES = ("clean", "accepted", "internal", "hang", "reset")


class EchoBackend:
    """Byte tokens; generates the prompt's first bytes back (no model)."""

    model_id, eos_id, special, context, expert_failures = "fake", 256, {}, 1024, []

    def __init__(self):
        from reap.serve.chat import ChatTemplate

        self.template = ChatTemplate()

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", "replace")

    def tokens(self, ids, *, max_tokens, temperature, top_p, seed):
        yield from ids[:max_tokens]
        yield self.eos_id

    def close(self) -> None:
        pass


def start_server(read_timeout: float, max_connections: int):
    """The server under test and whether it took the limits (an older checkout may not)."""
    from reap.serve.http import Server

    try:
        from reap.serve.limits import Limits

        limits = Limits(max_connections=max_connections, read_timeout=read_timeout)
        return Server(EchoBackend(), "127.0.0.1", 0, limits=limits).start(), True
    except ImportError:
        return Server(EchoBackend(), "127.0.0.1", 0).start(), False


def request(port: int, method: str, headers: dict, body: bytes = b"") -> bytes:
    lines = [f"{method} /v1/completions HTTP/1.1"]
    lines += [f"{k}: {v}" for k, v in {"Host": f"127.0.0.1:{port}", **headers}.items()
              if v is not None]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def exchange(port: int, data: bytes, wait: float, head: bool = False,
             abusive: bool = True) -> str:
    """Send `data`, read one answer; its outcome (`abusive`: a 2xx is not clean)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=wait) as sock:
            sock.sendall(data)
            resp = http.client.HTTPResponse(sock, method="HEAD" if head else "POST")
            resp.begin()
            outcome = judge(resp.status, resp.getheader("Content-Type"), resp.read(), head)
            return "accepted" if abusive and resp.status < 300 else outcome
    except (ConnectionResetError, BrokenPipeError, ConnectionRefusedError):
        return "reset"
    except TimeoutError:
        return "hang"
    except (http.client.RemoteDisconnected, http.client.BadStatusLine):
        return "internal"  # closed without answering a request


def judge(status: int, content_type: str | None, body: bytes, head: bool) -> str:
    if status >= 500 and status != 503 and status != 501 and status != 505:
        return "internal"
    if content_type != "application/json":
        return "internal"
    if head:
        return "clean"
    try:
        obj = json.loads(body)
    except ValueError:
        return "internal"
    if status >= 400 and set(obj.get("error", {})) != {"message", "type", "param", "code"}:
        return "internal"
    return "clean"


def slowloris(port: int, wait: float) -> str:
    """Trickle header bytes until the server answers or closes."""
    deadline = time.monotonic() + wait
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=wait) as sock:
            sock.sendall(request(port, "POST", {"Content-Type": "application/json"})[:-2])
            sock.settimeout(0.05)
            answer = b""
            while time.monotonic() < deadline:
                try:
                    sock.sendall(b"X-Slow: a\r\n")
                    answer = sock.recv(65536)
                    break
                except TimeoutError:
                    continue
            else:
                return "hang"
            if not answer:
                return "internal"
            sock.settimeout(wait)  # the rest of the answer, up to the server's close
            while more := sock.recv(65536):
                answer += more
            head, _, body = answer.decode("latin-1").partition("\r\n\r\n")
            lines = head.split("\r\n")
            fields = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
            return judge(int(lines[0].split()[1]), fields.get("Content-Type"), body, False)
    except (ConnectionResetError, BrokenPipeError):
        return "reset"


def idle(port: int, wait: float) -> str:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=wait) as sock:
            return "clean" if sock.recv(65536) == b"" else "internal"
    except TimeoutError:
        return "hang"
    except ConnectionResetError:
        return "reset"


def flood(port: int, wait: float, rng: random.Random) -> list[str]:
    """32-48 clients at once, 3 requests each on one kept-alive connection (reopened after a
    503, which closes it)."""
    n, outcomes = rng.randint(32, 48), []
    body = json.dumps({"prompt": "flood", "max_tokens": 4}).encode()
    go = threading.Barrier(n)

    def client():
        go.wait(wait)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=wait)
        for _ in range(3):
            outcomes.append(ask(conn, body))
        conn.close()

    threads = [threading.Thread(target=client) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * wait)
    return outcomes


def ask(conn: http.client.HTTPConnection, body: bytes) -> str:
    """One valid request on a kept-alive connection; its outcome."""
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return judge(resp.status, resp.getheader("Content-Type"), resp.read(), False)
    except (ConnectionResetError, BrokenPipeError, ConnectionRefusedError):
        outcome = "reset"
    except TimeoutError:
        outcome = "hang"
    except (http.client.RemoteDisconnected, http.client.BadStatusLine):
        outcome = "internal"
    conn.close()
    return outcome


def probe(kind: str, port: int, wait: float, rng: random.Random) -> list[str]:
    """Outcomes of one probe of `kind` (one per connection)."""
    json_type = {"Content-Type": "application/json"}
    good = json.dumps({"prompt": "hello", "max_tokens": 3}).encode()
    if kind == "length":
        length = rng.choice(["-1", "-20000000", "+5", "1e3", "0x10", "99999999999", "5, 6",
                             str(len(good) + 50)])  # the last one: a body that never comes
        return [exchange(port, request(port, "POST", {**json_type, "Content-Length": length},
                                       good), wait)]
    if kind == "chunked":
        size = rng.choice([16, 4096, 1 << 20])
        chunk = b"x" * size
        valid = b"%x\r\n%s\r\n0\r\n\r\n" % (len(good), good)
        body = rng.choice([b"%x\r\n%s\r\n" % (size, chunk) * rng.randint(1, 12) + b"0\r\n\r\n",
                           b"zz\r\n\r\n", b"%x\r\n%s0\r\n\r\n" % (len(good), good), valid])
        return [exchange(port, request(port, "POST", {**json_type,
                                                       "Transfer-Encoding": "chunked"}, body),
                         wait, abusive=body != valid)]
    if kind == "slowloris":
        return [slowloris(port, wait)]
    if kind == "idle":
        return [idle(port, wait)]
    if kind == "flood":
        return flood(port, wait, rng)
    if kind == "method":
        method = rng.choice(["PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "HEAD", "BREW", "get"])
        return [exchange(port, request(port, method, {"Content-Length": 0}), wait,
                         head=method == "HEAD")]
    if kind == "host":
        headers = rng.choice([{"Host": "evil.example"}, {"Origin": "http://evil.example"},
                              {"Origin": "null"}, {"Content-Type": "text/plain"},
                              {"Content-Type": None}, {"Host": None}])
        return [exchange(port, request(port, "POST", {**json_type, "Content-Length": len(good),
                                                      **headers}, good), wait)]
    if kind == "garbage":
        junk = bytes(rng.randrange(1, 256) for _ in range(rng.randint(1, 300)))
        return [exchange(port, junk + rng.choice([b"\r\n\r\n", b""]), wait)]
    if kind == "json_bomb":
        depth = rng.randint(1000, 200_000)
        body = rng.choice([b"[" * depth + b"]" * depth, b"[" + b"{}," * 300_000 + b"{}]",
                           b'{"prompt": "x", "seed": 1' + b"0" * 5000 + b"}",
                           b'{"prompt": "\xff\xfe"}', b'"just a string"'])
        return [exchange(port, request(port, "POST", {**json_type, "Content-Length": len(body)},
                                       body), wait)]
    if kind == "huge_prompt":
        body = json.dumps({"prompt": "word " * rng.randint(10_000, 1_500_000)}).encode()
        return [exchange(port, request(port, "POST", {**json_type, "Content-Length": len(body)},
                                       body), wait)]
    return [exchange(port, request(port, "POST", {**json_type, "Content-Length": len(good)},
                                   good), wait, abusive=False)]


def run(seed: int, count: int, time_limit: float, read_timeout: float,
        max_connections: int) -> dict:
    """Fire the probes; the counts per kind and outcome, and the run's facts."""
    server, limited = start_server(read_timeout, max_connections)
    port, wait = server.httpd.server_address[1], read_timeout + 5
    errors_before = getattr(server.httpd, "errors", None)  # None: that server does not count
    rng, counts = random.Random(seed), {k: Counter() for k in KINDS}
    started, probes = time.monotonic(), 0
    try:
        while probes < count and time.monotonic() - started < time_limit:
            kind = rng.choice(KINDS)
            counts[kind].update(probe(kind, port, wait, rng))
            probes += 1
    finally:
        handler_errors = "n/a" if errors_before is None else server.httpd.errors - errors_before
        refuser = getattr(server.httpd, "refuser", None)
        capped = refuser.refused if refuser else "n/a"
        server.stop()
    return {"counts": counts, "probes": probes, "seconds": time.monotonic() - started,
            "limited": limited, "handler_errors": handler_errors, "capped": capped,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def report(result: dict, command: str) -> str:
    """The markdown report of one run."""
    rows = ["| kind | tried | " + " | ".join(OUTCOMES) + " |", "|---" * (len(OUTCOMES) + 2) + "|"]
    total = Counter()
    for kind, c in result["counts"].items():
        total.update(c)
        rows.append(f"| {kind} | {sum(c.values())} | " + " | ".join(str(c[o]) for o in OUTCOMES)
                    + " |")
    rows.append(f"| **all** | **{sum(total.values())}** | "
                + " | ".join(f"**{total[o]}**" for o in OUTCOMES) + " |")
    return "\n".join([
        "# Server reliability under abuse", "",
        f"Command: `{command}`", "",
        (f"{result['probes']} probes ({sum(total.values())} connections) in "
         f"{result['seconds']:.0f} s; handler exceptions on the server: "
         f"{result['handler_errors']}; connections over the cap answered 503: "
         f"{result['capped']}; peak RSS of the process (server and clients): "
         f"{result['peak_rss_mb']:.0f} MB; limits applied: {result['limited']}."), "",
        *rows, "",
        ("Outcomes: clean = a JSON answer (OpenAI error shape) or, for an idle connection, a "
         "close; accepted = an abusive request answered 2xx; internal = a 5xx other than 503, a non-JSON answer or a close without one; "
         "hang = nothing within read timeout + 5 s; reset = connection reset or refused. "
         "See the docstring of `experiments/fuzz_server.py` for the probe kinds."), ""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--count", type=int, default=300, help="probes (default 300)")
    p.add_argument("--time-limit", type=float, default=180, help="seconds (default 180)")
    p.add_argument("--read-timeout", type=float, default=1.0, help="server read timeout (1 s)")
    p.add_argument("--max-connections", type=int, default=16, help="server cap (16)")
    p.add_argument("--out", help="write the markdown report here")
    args = p.parse_args(argv)
    result = run(args.seed, args.count, args.time_limit, args.read_timeout, args.max_connections)
    text = report(result, "python experiments/fuzz_server.py " + " ".join(argv or sys.argv[1:]))
    print(text)
    if args.out:
        from reap.fileio import write_atomic

        write_atomic(Path(args.out), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
