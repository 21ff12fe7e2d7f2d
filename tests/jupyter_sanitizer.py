"""What an untrusted Jupyter notebook does to an HTML output, for tests: JupyterLab's sanitizer rules, applied.

JupyterLab (packages/apputils/src/sanitizer.ts) passes an untrusted output through sanitize-html with its own
allow-lists: a tag off the list is dropped and its children kept, except ``<script>``, ``<style>``,
``<textarea>`` and ``<option>`` off the list, whose content goes too (sanitize-html's "non-text tags"); an
attribute off the list is dropped; ``<img src>`` keeps any scheme (``data:`` included). The lists below are
JupyterLab 4.6's. Two rules of sanitize-html matter as much: an attribute written without a value (or with an
empty one) is dropped when sanitize-html counts it among the attributes that need a value
(``nonBooleanAttributes``), whatever the allow-list says: so a bare ``hidden`` goes, ``hidden="hidden"`` stays;
and JupyterLab renames ``id`` to ``data-jupyter-id`` (and makes every ``<input>`` disabled). Not emulated: its
per-property check of inline CSS values (a declaration it refuses only loses that declaration, never an
element). tests/lab/test_jupyterlab.py checks the real thing, in a JupyterLab driven by the browser.
"""

from __future__ import annotations

import html
from html.parser import HTMLParser

ALLOWED_TAGS = frozenset(
    """a abbr acronym address area article aside audio b bdi bdo big blockquote br button canvas caption center
    cite code col colgroup colspan command data datalist dd del details dfn dir div dl dt em fieldset figcaption
    figure font footer form h1 h2 h3 h4 h5 h6 header hgroup hr i img input ins kbd label legend li map mark menu
    meter nav nobr ol optgroup option output p pre progress q rowspan s samp section select small source span
    strike strong sub summary sup table tbody td textarea tfoot th thead time tr track tt u ul var video
    wbr""".split()
)
GLOBAL_ATTRIBUTES = frozenset(
    "class data-jupyter-id dir draggable hidden id inert itemprop itemref itemscope lang spellcheck style title "
    "translate".split()
)
# sanitize-html's attributes that need a value (its list, less the event handlers, which no allow-list has): one of
# them written bare or empty is dropped, unless it is in EMPTY_ALLOWED
NON_BOOLEAN_ATTRIBUTES = frozenset(
    """abbr accept accept-charset accesskey action allow alt as autocapitalize autocomplete blocking charset cite
    class color cols colspan content contenteditable coords crossorigin data datetime decoding dir dirname download
    draggable enctype enterkeyhint fetchpriority for form formaction formenctype formmethod formtarget headers
    height hidden high href hreflang http-equiv id imagesizes imagesrcset inputmode integrity is itemid itemprop
    itemref itemtype kind label lang list loading low max maxlength media method min minlength name nonce optimum
    pattern ping placeholder popover popovertarget popovertargetaction poster preload referrerpolicy rel rows
    rowspan sandbox scope shape size sizes slot span spellcheck src srcdoc srclang srcset start step style tabindex
    target title translate type usemap value width wrap""".split()
)
EMPTY_ALLOWED = frozenset({"alt"})
_CELL_ATTRIBUTES = frozenset(
    "abbr align axis bgcolor char charoff colspan headers height nowrap rowspan scope valign width".split()
)
TAG_ATTRIBUTES = {
    "img": frozenset("align alt border height hspace ismap name src usemap vspace width".split()),
    "td": frozenset(
        "abbr align axis bgcolor char charoff colspan headers height nowrap rowspan scope valign width".split()
    ),
    "th": frozenset(
        "abbr align axis bgcolor char charoff colspan headers height nowrap rowspan scope valign width".split()
    ),
    "table": frozenset("align bgcolor border cellpadding cellspacing frame rules summary width".split()),
    "caption": frozenset(["align"]),
    "div": frozenset(["align"]),
    "p": frozenset(["align"]),
    "select": frozenset("autocomplete disabled multiple name required size tabindex".split()),
    "button": frozenset("accesskey disabled name tabindex type value".split()),
    "input": frozenset("accept accesskey align alt autocomplete checked disabled name type value".split()),
    "canvas": frozenset("height width".split()),
    "label": frozenset("accesskey for".split()),
    "details": frozenset(["open"]),
}
NON_TEXT_TAGS = frozenset({"script", "style", "textarea", "option"})
VOID_TAGS = frozenset({"area", "br", "col", "hr", "img", "input", "source", "track", "wbr"})


class _Sanitizer(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=False)
        self.out: list[str] = []
        self.skipping: str | None = None  # a non-text tag off the list whose content is dropped

    def handle_starttag(self, tag, attrs):
        if self.skipping:
            return
        if tag not in ALLOWED_TAGS:
            if tag in NON_TEXT_TAGS:
                self.skipping = tag
            return
        allowed = GLOBAL_ATTRIBUTES | TAG_ATTRIBUTES.get(tag, frozenset())
        kept = {}
        for name, value in attrs:
            if not value and name in NON_BOOLEAN_ATTRIBUTES and name not in EMPTY_ALLOWED:
                continue  # `hidden` or `hidden=""`: dropped
            if name in allowed:
                kept["data-jupyter-id" if name == "id" else name] = value
        if tag == "input":
            kept["disabled"] = "disabled"
        self.out.append(
            f"<{tag}"
            + "".join(
                f" {name}" if value is None else f' {name}="{html.escape(value)}"' for name, value in kept.items()
            )
            + ">"
        )

    def handle_endtag(self, tag):
        if self.skipping:
            if tag == self.skipping:
                self.skipping = None
            return
        if tag in ALLOWED_TAGS and tag not in VOID_TAGS:
            self.out.append(f"</{tag}>")

    def handle_data(self, data):
        if not self.skipping:
            self.out.append(html.escape(data, quote=False))

    def handle_entityref(self, name):
        if not self.skipping:
            self.out.append(f"&{name};")

    def handle_charref(self, name):
        if not self.skipping:
            self.out.append(f"&#{name};")


def sanitized(markup: str) -> str:
    """``markup`` as an untrusted notebook shows it (see the module docstring)."""
    parser = _Sanitizer()
    parser.feed(markup)
    parser.close()
    return "".join(parser.out)
