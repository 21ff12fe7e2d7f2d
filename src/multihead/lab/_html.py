"""What every HTML page multihead writes shares: jinja2 templates packaged beside a module, autoescaped, strict
about undefined names, and pure ASCII (a page reads the same whatever encoding it is saved with).

    environment = template_environment("multihead.lab.inspect")   # its templates/ folder
    environment.get_template("report.html.j2").render(...)

Inside a template, ``|ascii`` HTML-escapes a value and writes every non-ASCII character as a character reference,
and ``|tojson`` writes compact, ASCII JSON that refuses NaN and infinity (in the data they are a bug, not
something to write as invalid JSON).
"""

from __future__ import annotations

import functools

import jinja2
from markupsafe import Markup, escape

__all__ = ["JSON_OPTIONS", "ascii_html", "template_environment"]

JSON_OPTIONS = {"separators": (",", ":"), "ensure_ascii": True, "allow_nan": False}


def ascii_html(value: object) -> Markup:
    """HTML-escaped text with every non-ASCII character as a character reference (the page stays ASCII)."""
    return Markup(str(escape(value)).encode("ascii", "xmlcharrefreplace").decode("ascii"))


@functools.cache
def template_environment(package: str) -> jinja2.Environment:
    """The jinja2 environment of the templates in ``package``'s ``templates/`` folder (see the module docstring)."""
    environment = jinja2.Environment(
        loader=jinja2.PackageLoader(package, "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )
    environment.filters["ascii"] = ascii_html
    environment.policies["json.dumps_kwargs"] = JSON_OPTIONS
    return environment
