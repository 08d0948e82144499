"""Strings from a workload (or any other input) made safe to print.

A request id is any JSON string: it may hold escape sequences that recolour a terminal
or set its title, a newline that splits a one-line message in two, a NUL, a bidi
override, or a lone surrogate (``"\\ud800"`` is valid JSON) that no encoder accepts. So
nothing from the input reaches a terminal, a log or a plot as it is:

- ``shown(s)``: an id or name as it is when it is plain (printable, no quote, no
  backslash, no surrounding space), else its Python ``repr`` (quoted, escaped), so a
  plain id reads as before and a strange one cannot be mistaken for a plain one;
- ``one_line(s)``: a message whose own words are kept but whose unprintable characters
  (newlines included) are escaped: the last guard of everything printed on one line;
- ``plot_text(s)``: ``one_line`` for matplotlib, whose ``$...$`` starts mathtext.

The JSON document needs none of this: ``json.dumps`` escapes every non-ASCII character
(``\\ud800`` included), so it round-trips.
"""

from __future__ import annotations

_QUOTES = frozenset("'\"\\")


def one_line(text: str) -> str:
    """``text`` with every unprintable character escaped (``\\n``, ``\\x1b``, ``\\ud800``).

    post: __return__.isprintable()
    """
    if text.isprintable():
        return text
    # repr writes an unprintable character as its escape (repr("\x1b") == "'\\x1b'").
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _plain(text: str) -> bool:
    return (
        text != ""
        and text.isprintable()
        and text == text.strip()
        and not any(c in _QUOTES for c in text)
    )


def shown(text: str) -> str:
    """An id or name for a message: as it is if plain, else quoted and escaped (``repr``)."""
    return text if _plain(text) else one_line(repr(text))


def plot_text(text: str) -> str:
    """``one_line(text)`` with ``$`` escaped, so matplotlib draws it as written."""
    return one_line(text).replace("$", r"\$")
