"""Chat templates rendered within bounds (`render`, for `reap.serve.chat`): a template is the
checkpoint's code, so it runs in Jinja's sandbox, set up as Hugging Face sets it up, in a child
process (this file alone, JSON in and out) with its address space capped, killed after `SECONDS`,
stopped at `max_chars` characters of output as Jinja streams them; the server only waits on it.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from datetime import datetime

SECONDS = 5.0  # the render time bound (the child's start, about 0.1 s, included)
MEMORY = 256 << 20  # the child's address space, plus 64 bytes a character of the output bound
# run this file without its directory on sys.path (reap/serve/http.py would shadow stdlib http)
_BOOT = "import runpy, sys; del sys.path[0]; runpy.run_path(sys.argv[1], run_name='__main__')"


def render(source: str, variables: dict, max_chars: int) -> dict:
    """{"text": output} of template `source` given `variables` (JSON values), or {"error": one
    line naming the bound passed or the template's error}."""
    memory, request = MEMORY + 64 * max_chars, (source, variables, max_chars)
    try:
        done = subprocess.run([sys.executable, "-c", _BOOT, __file__, str(memory)],
                              input=json.dumps(request).encode(), capture_output=True, check=False,
                              timeout=SECONDS)
        return json.loads(done.stdout)
    except subprocess.TimeoutExpired:
        return {"error": f"chat template rendering took over the {SECONDS:g} s limit"}
    except ValueError:  # no answer
        return {"error": f"chat template rendering failed: its process ended ({done.returncode})"}


class _Refused(Exception):
    pass


def _main(memory: int) -> None:
    import resource

    with contextlib.suppress(ValueError, OSError):  # a lower hard limit, or no such limit here
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    try:
        reply = {"text": _generate(*json.load(sys.stdin))}
    except MemoryError:
        reply = {"error": f"chat template rendering passed the {memory >> 20} MiB memory limit"}
    except Exception as e:  # noqa: BLE001 - any Jinja error: the template's or the request's
        reply = {"error": str(e) if isinstance(e, _Refused) else
                 f"chat template failed: {type(e).__name__}: {' '.join(str(e).split())}"}
    json.dump(reply, sys.stdout)


def _generate(source: str, variables: dict, max_chars: int) -> str:
    out, n = [], 0
    for chunk in _compile(source).generate(**variables):
        n += len(chunk)
        if n > max_chars:
            raise _Refused(f"the rendered prompt is over the limit of {max_chars} characters "
                           "(--max-prompt-chars)")
        out.append(chunk)
    return "".join(out)


def _compile(source: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    env.filters["tojson"] = _tojson
    return env.from_string(source)


def _raise_exception(message: str):
    raise _Refused(f"chat template refused the request: {' '.join(str(message).split())}")


def _strftime_now(fmt: str) -> str:
    """The local time now in `fmt` (templates such as gpt-oss's date their system message)."""
    return datetime.now().strftime(fmt)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """JSON without Jinja's HTML escaping, with the options templates pass."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


if __name__ == "__main__":
    _main(int(sys.argv[2]))
