"""Chat templates rendered within bounds, in a child process (`reap.serve.chat` uses it).

A checkpoint's template is code: it runs in Jinja's immutable sandbox, set up as Hugging Face
sets it up (`raise_exception`, `strftime_now`, a `tojson` taking `ensure_ascii`/`indent`/
`sort_keys`), in a process of its own whose address space is capped, stopped after `seconds`
(by a timer in the child; the parent kills a child that misses it) and at `max_chars`
characters of output, counted as Jinja streams them. A template that loops for hours or builds
a gigabyte string is refused in one line, and the server's threads only wait on a pipe meanwhile.
The child runs this file alone (it imports nothing of reap): JSON lines in, JSON lines out.
"""

from __future__ import annotations

import contextlib
import json
import select
import subprocess
import sys
import threading
from datetime import datetime

SECONDS = 5.0  # the render time bound
MEMORY = 256 << 20  # the child's address space, plus 64 bytes a character of the output bound
GRACE = 10.0  # seconds the parent waits past the child's own timer (its start included)
# run this file without its directory on sys.path (reap/serve/http.py would shadow stdlib http)
_BOOT = "import runpy, sys; del sys.path[0]; runpy.run_path(sys.argv[1], run_name='__main__')"


class Renderer:
    """One template `source` rendered in a child process (started at the first render, again
    after one was stopped); threads take turns."""

    def __init__(self, source: str):
        self.source, self._child, self._lock = source, None, threading.Lock()

    def render(self, variables: dict, max_chars: int, seconds: float = SECONDS) -> str:
        """The output for `variables` (JSON values); RequestError naming the bound it passed, or
        the template's error, in one line."""
        from reap.serve.params import RequestError

        request = json.dumps({"variables": variables, "max_chars": max_chars, "seconds": seconds})
        with self._lock:
            reply = self._exchange(request.encode() + b"\n", max_chars, seconds)
        if "text" not in reply:
            raise RequestError(reply["error"])
        return reply["text"]

    def _exchange(self, request: bytes, max_chars: int, seconds: float) -> dict:
        if self._child is None or self._child.poll() is not None:
            self._child = subprocess.Popen([sys.executable, "-c", _BOOT, __file__],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           stderr=subprocess.DEVNULL)
            head = {"source": self.source, "memory": MEMORY + 64 * max_chars}
            request = json.dumps(head).encode() + b"\n" + request
        child = self._child
        try:
            child.stdin.write(request)
            child.stdin.flush()
            if select.select([child.stdout], [], [], seconds + GRACE)[0]:
                return json.loads(child.stdout.readline())
            reply = {"error": _over_time(seconds)}  # the child missed its own timer
        except (OSError, ValueError):  # it died: killed, or crashed
            reply = {"error": "chat template rendering failed: its process ended"}
        self.close()
        return reply

    def close(self) -> None:
        """Stop the child process (a later render starts another)."""
        child, self._child = self._child, None
        if child is not None:
            child.kill()
            child.wait()
            with contextlib.suppress(OSError):  # what a dead child was not sent
                child.stdin.close()
            child.stdout.close()

    __del__ = close


def _over_time(seconds: float) -> str:
    return f"chat template rendering took over the {seconds:g} s limit"


class _Refused(Exception):
    pass


class _Expired(BaseException):  # not an Exception: nothing in Jinja catches it
    pass


def _main() -> None:
    """The child: render each request line with the template of the first line."""
    import resource
    import signal

    head = json.loads(sys.stdin.buffer.readline())
    try:
        resource.setrlimit(resource.RLIMIT_AS, (head["memory"], head["memory"]))
    except (ValueError, OSError):  # a lower hard limit, or a system without it
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server's Ctrl-C is the server's to handle
    signal.signal(signal.SIGALRM, _expire)
    template = None
    for line in sys.stdin.buffer:
        req = json.loads(line)
        try:
            signal.setitimer(signal.ITIMER_REAL, req["seconds"])
            template = template or _compile(head["source"])
            reply = {"text": _generate(template, req["variables"], req["max_chars"])}
        except _Expired:
            reply = {"error": _over_time(req["seconds"])}
        except MemoryError:
            reply = {"error": f"chat template rendering needs over the {head['memory'] >> 20} "
                              "MiB memory limit"}
        except _Refused as e:
            reply = {"error": str(e)}
        except Exception as e:  # noqa: BLE001 - any Jinja error: the template's or the request's
            reply = {"error": f"chat template failed: {type(e).__name__}: {_one_line(e)}"}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        sys.stdout.buffer.write(json.dumps(reply).encode() + b"\n")
        sys.stdout.buffer.flush()


def _expire(signum, frame):
    raise _Expired


def _generate(template, variables: dict, max_chars: int) -> str:
    out, n = [], 0
    for chunk in template.generate(**variables):
        n += len(chunk)
        if n > max_chars:
            raise _Refused(f"the rendered prompt is over the limit of {max_chars} characters "
                           "(--max-prompt-chars)")
        out.append(chunk)
    return "".join(out)


def _compile(source: str):
    try:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise _Refused("this checkpoint ships a chat template: install jinja2 to use it"
                       ) from None
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    env.filters["tojson"] = _tojson
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise _Refused(f"chat template does not compile: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _raise_exception(message: str):
    raise _Refused(f"chat template refused the request: {_one_line(message)}")


def _strftime_now(fmt: str) -> str:
    """The local time now in `fmt` (templates such as gpt-oss's date their system message)."""
    return datetime.now().strftime(fmt)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """JSON without Jinja's HTML escaping, with the options templates pass."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


if __name__ == "__main__":
    _main()
