"""A tokenizer's ``chat_template`` rendered in a bounded sandbox: a template is code from a download.

The template runs in jinja2's immutable sandbox (no attribute escapes such as
``cycler.__init__.__globals__``), and within bounds: its source at most `SOURCE_LIMIT` bytes, each
render at most `OUTPUT_LIMIT` characters (a repetition that would pass it is refused before it is
built) and `TIME_LIMIT` seconds (in the main thread, by a timer). A template that breaks any of
these, or does not parse, is a `ChatTemplateError`: one line naming where it came from.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

SOURCE_LIMIT = 1 << 20  # bytes of template text
OUTPUT_LIMIT = 1 << 24  # characters one render may produce (a conversation is far shorter)
TIME_LIMIT = 10.0  # seconds one render may take


class ChatTemplateError(ValueError):
    """A chat template that cannot be rendered safely: one line naming it."""

    user_facing = True


class _Timeout(Exception):
    pass


def _environment() -> Any:
    import jinja2.sandbox

    class Bounded(jinja2.sandbox.ImmutableSandboxedEnvironment):
        """The immutable sandbox, refusing a ``*`` or ``**`` whose result would be huge before computing it."""

        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > OUTPUT_LIMIT:
                        raise jinja2.sandbox.SecurityError(f"a repetition of {len(seq) * n} items passes the "
                                                           f"{OUTPUT_LIMIT} a render may produce")
            if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(right) > 4096:
                raise jinja2.sandbox.SecurityError(f"a power of {right} is past what a template may compute")
            return super().call_binop(context, operator, left, right)

    return Bounded(trim_blocks=True, lstrip_blocks=True)


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise `_Timeout` in the render after ``seconds`` (main thread only: signals need it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise _Timeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class ChatTemplate:
    """``source`` compiled once; `render` returns the text, or raises `ChatTemplateError` naming ``where``."""

    def __init__(self, source: str, where: str) -> None:
        import jinja2

        self.where = where
        if len(source.encode("utf-8", errors="replace")) > SOURCE_LIMIT:
            raise ChatTemplateError(f"{where}: the chat_template is {len(source)} characters, past the "
                                    f"{SOURCE_LIMIT} bytes a template may take")
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as err:
            raise ChatTemplateError(f"{where}: the chat_template does not parse (line {err.lineno}: {err.message}); "
                                    "fix it, or use prompt/completion rows") from None
        except (jinja2.TemplateError, RecursionError, MemoryError) as err:
            raise ChatTemplateError(f"{where}: the chat_template cannot be compiled ({_one_line(err)})") from None

    def render(self, **context: Any) -> str:
        import jinja2
        import jinja2.sandbox

        parts, size = [], 0
        try:
            with _time_limit(TIME_LIMIT):
                for part in self._template.generate(**context):
                    size += len(part)
                    if size > OUTPUT_LIMIT:
                        raise ChatTemplateError(f"{self.where}: the chat_template renders more than {OUTPUT_LIMIT} "
                                                "characters for one conversation; refusing it")
                    parts.append(part)
        except _Timeout:
            raise ChatTemplateError(f"{self.where}: the chat_template took more than {TIME_LIMIT:g} s to render one "
                                    "conversation; refusing it") from None
        except jinja2.sandbox.SecurityError as err:
            raise ChatTemplateError(f"{self.where}: the chat_template does what the sandbox forbids "
                                    f"({_one_line(err)}); a chat template only formats messages") from None
        except (jinja2.TemplateError, RecursionError, MemoryError, TypeError, ValueError, ArithmeticError) as err:
            if isinstance(err, ChatTemplateError):
                raise
            raise ChatTemplateError(f"{self.where}: the chat_template fails to render ({type(err).__name__}: "
                                    f"{_one_line(err)})") from None
        return "".join(parts)


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())[:300]
