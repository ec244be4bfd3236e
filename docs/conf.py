"""Sphinx configuration of asyncload's documentation site (``make docs``).

The guides are Markdown (MyST); the API reference is generated here, at every build, from
``asyncload.__all__``: one page per public name, filled by autodoc from its docstring. The reference
page's tables are generated too (``reference_tables.py``). A name added to
``__all__`` gets its page without an edit here, and a public name that ends up without a documented
object is a warning, which ``make docs`` (``sphinx-build -W``) turns into a failure.
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # this checkout's asyncload, whatever is installed

import asyncload  # noqa: E402

project = "asyncload"
author = "The asyncload authors"
copyright = "The asyncload authors"
release = version = asyncload.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
# _toc.md: included by api/index; reference/generated/*.md: included by reference.md
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "api/generated/_toc.md", "reference/generated"]
html_theme = "furo"
html_title = f"asyncload {release}"
html_static_path: list[str] = []

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # [text](page.md#a-heading) links to headings down to ###

# Strict: every cross-reference must resolve (make docs adds -W, so a broken one fails the build). Types of
# other libraries in signatures are not ours to resolve without intersphinx (the build needs no network).
nitpicky = True
# Nor are the private modules' types that annotations name (a public name resolves by its own page).
nitpick_ignore_regex = [
    (r"py:.*", r"^(?!asyncload\b).*"),
    (r"py:.*", r"^asyncload\.(engine|image|processes|runtime|sources|tools)\..*"),
]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
default_role = "literal"  # the docstrings' `name` (Markdown habit) reads as code, not as a title

API = DOCS / "api" / "generated"
#: what the public names that are plain values hold (a class or function documents itself)
VALUES = {"__version__": f"The installed version, ``{asyncload.__version__}`` here; ``asyncload --version`` prints it."}


def _directive(name: str) -> str:
    try:
        obj = getattr(asyncload, name)
    except AttributeError:  # a name in __all__ that does not import: autodoc warns, and so does the check below
        return "autodata"
    if inspect.isclass(obj):
        return "autoexception" if issubclass(obj, BaseException) else "autoclass"
    if inspect.isfunction(obj):
        return "autofunction"
    return "autodata"


def _page(name: str) -> str:
    text = f"{name}\n{'=' * len(name)}\n\n.. currentmodule:: asyncload\n\n"
    if name in VALUES:  # a plain value: autodoc would show its type's docstring (str's, for a version)
        value = getattr(asyncload, name)
        return text + f".. py:data:: {name}\n   :type: {type(value).__name__}\n\n   {VALUES[name]}\n"
    return text + f".. {_directive(name)}:: {name}\n"


def _toc(names: list[str]) -> str:
    """The API index's lists, by kind (api/index.md includes it)."""
    kinds: dict[str, list[str]] = {"Classes": [], "Errors": [], "Functions and values": []}
    for name in names:
        kind = _directive(name)
        kinds[
            "Errors" if kind == "autoexception" else "Classes" if kind == "autoclass" else "Functions and values"
        ].append(name)
    return "".join(
        f"## {kind}\n\n```{{toctree}}\n:maxdepth: 1\n\n" + "".join(f"generated/{n}\n" for n in members) + "```\n\n"
        for kind, members in kinds.items()
        if members
    )


def write_api_pages() -> list[str]:
    """One page per name of ``asyncload.__all__`` and the index's lists (rewritten when they change, so
    that an incremental build rereads only what changed; pages of names no longer public removed)."""
    API.mkdir(parents=True, exist_ok=True)
    names = sorted(asyncload.__all__, key=str.lower)
    pages = {f"{name}.rst": _page(name) for name in names} | {"_toc.md": _toc(names)}
    for old in API.glob("*.rst"):
        if old.name not in pages:
            old.unlink()
    for file, text in pages.items():
        path = API / file
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
    return names


PUBLIC = write_api_pages()

# The reference tables (settings, stats() keys, environment, support matrix), rendered from the code at
# every build (reference_tables.py says from what), so that they cannot drift from it.
sys.path.insert(0, str(DOCS))
import reference_tables  # noqa: E402

#: Committed tables this build found stale and rewrote: a warning (an error under -W), so that a change to a
#: setting, a stats() key or a pin is committed with its table and GitHub never shows an old one.
STALE_TABLES = reference_tables.write(DOCS / "reference" / "generated")

# The docstrings list settings as indented ``name  what it does`` lines under a heading ending in ':'
# (``help()`` shows them as they are). For the site they become definition lists.
_HEAD = re.compile(r"^(\s*)(\S.*[^:]):$")
_ITEM = re.compile(r"^(\s*)([\w.*]+(?:, [\w.*]+)*|[\w\"'/:.*() ]+?)\s{2,}(\S.*)$")


def settings_lists(app, what, name, obj, options, lines: list[str]) -> None:
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        head = _HEAD.match(line)
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if head and nxt.strip() and len(nxt) - len(nxt.lstrip()) > len(head.group(1)):
            indent = len(nxt) - len(nxt.lstrip())
            block: list[str] = []
            j = i + 1
            while j < len(lines) and lines[j].strip() and len(lines[j]) - len(lines[j].lstrip()) >= indent:
                block.append(lines[j])
                j += 1
            items = _definitions(block, indent)
            if items is not None:
                out += [head.group(1) + head.group(2) + ":", ""]
                for term, body in items:
                    out.append(head.group(1) + term)
                    out += [head.group(1) + "   " + b for b in body]
                    out.append("")
                i = j
                continue
        out.append(line)
        i += 1
    lines[:] = out


def _definitions(block: list[str], indent: int) -> list[tuple[str, list[str]]] | None:
    """``name  text`` lines (continuations indented deeper, to the text's column) as (term, body), or
    None where the block is not such a list."""
    items: list[tuple[str, list[str]]] = []
    deeper = [len(ln) - len(ln.lstrip()) for ln in block if len(ln) - len(ln.lstrip()) > indent]
    col = min(deeper, default=0)
    for line in block:
        own = len(line) - len(line.lstrip())
        if own == indent:
            if col and len(line) > col and line[col - 1] == " " and line[col] != " " and line[indent:col].strip():
                items.append((line[indent:col].strip(), [line[col:].strip()]))
                continue
            m = _ITEM.match(line)
            if not m:
                return None
            items.append((m.group(2).strip(), [m.group(3).strip()]))
        elif items:
            items[-1][1].append(line.strip())
        else:
            return None
    return items


def check_every_public_name(app, env) -> None:
    """A name of ``__all__`` without a documented object is a warning (an error under -W)."""
    from sphinx.util import logging

    objects = env.get_domain("py").objects
    for name in PUBLIC:
        if f"asyncload.{name}" not in objects:
            logging.getLogger(__name__).warning("asyncload.%s is public (__all__) but has no API entry", name)


def warn_stale_tables(app) -> None:
    from sphinx.util import logging

    for name in STALE_TABLES:
        logging.getLogger(__name__).warning(
            "docs/reference/generated/%s.md was stale and is rewritten from the code now: commit it", name
        )


def setup(app) -> None:
    app.connect("builder-inited", warn_stale_tables)
    app.connect("autodoc-process-docstring", settings_lists)
    app.connect("env-check-consistency", check_every_public_name)
