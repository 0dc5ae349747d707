"""A tokenizer's ``chat_template`` rendered in a bounded sandbox: a template is code from a download.

The template runs in jinja2's immutable sandbox (no attribute escapes such as
``cycler.__init__.__globals__``), and within bounds: its source at most `SOURCE_LIMIT` bytes, each
render at most `OUTPUT_LIMIT` characters (a repetition that would pass it is refused before it is
built) and `TIME_LIMIT` seconds (in the main thread, by a timer). A template that breaks any of
these, or does not parse, is a `ChatTemplateError`: one line naming where it came from.

A template is compiled once per tokenizer and renders a whole conversation in one pass; its
``{% generation %}`` blocks (the transformers convention for "what the assistant writes") are
recorded as character spans of that one render, as ``return_assistant_tokens_mask`` reads them.
"""

from __future__ import annotations

import contextlib
import re
import signal
import threading
from collections.abc import Iterator
from typing import Any

SOURCE_LIMIT = 1 << 20  # bytes of template text
OUTPUT_LIMIT = 1 << 24  # characters one render may produce (a conversation is far shorter)
TIME_LIMIT = 10.0  # seconds one render may take
GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatTemplateError(ValueError):
    """A chat template that cannot be rendered safely: one line naming it."""

    user_facing = True


class _Timeout(Exception):
    pass


def _environment() -> Any:
    import jinja2.ext
    import jinja2.nodes
    import jinja2.sandbox

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: renders its body, and records where it lies in the output."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("mark", []), [], [], body).set_lineno(lineno)

        def mark(self, caller: Any) -> str:
            text = caller()
            tracker = self.environment.tracker
            if tracker is not None:  # the output so far has been yielded: its size is where this block starts
                tracker.spans.append((tracker.size, tracker.size + len(text)))
            return text

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

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[Generation])
    env.globals["raise_exception"] = raise_exception  # what transformers gives templates to refuse a conversation
    env.tracker = None
    return env


class _Tracker:
    """The characters rendered so far, and the ``{% generation %}`` spans seen."""

    def __init__(self) -> None:
        self.size = 0
        self.spans: list[tuple[int, int]] = []


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
        self.has_generation = bool(GENERATION_BLOCK.search(source))
        if len(source.encode("utf-8", errors="replace")) > SOURCE_LIMIT:
            raise ChatTemplateError(f"{where}: the chat_template is {len(source)} characters, past the "
                                    f"{SOURCE_LIMIT} bytes a template may take")
        try:
            self._env = _environment()
            self._template = self._env.from_string(source)
        except jinja2.TemplateSyntaxError as err:
            raise ChatTemplateError(f"{where}: the chat_template does not parse (line {err.lineno}: {err.message}); "
                                    "fix it, or use prompt/completion rows") from None
        except (jinja2.TemplateError, RecursionError, MemoryError) as err:
            raise ChatTemplateError(f"{where}: the chat_template cannot be compiled ({_one_line(err)})") from None

    def render(self, **context: Any) -> str:
        return self.render_marked(**context)[0]

    def render_marked(self, **context: Any) -> tuple[str, list[tuple[int, int]]]:
        """The text, and the character spans of its ``{% generation %}`` blocks."""
        import jinja2
        import jinja2.sandbox

        parts, tracker = [], _Tracker()
        self._env.tracker = tracker
        try:
            with _time_limit(TIME_LIMIT):
                for part in self._template.generate(**context):
                    tracker.size += len(part)
                    if tracker.size > OUTPUT_LIMIT:
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
        finally:
            self._env.tracker = None
        return "".join(parts), tracker.spans


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())[:300]
