"""The command line as the pages show it (issue 63): every ``asyncload`` command written in the CLI guide
and the quickstart is run, and what it prints is compared with the page, so that the next mismatch
between a page and the code fails here rather than on a newcomer's machine.

Two kinds of command are on the pages:

- **Transcripts**: a ``console`` block of ``$ asyncload ...`` lines, each followed by what it prints. Each
  is run as written, in a fresh directory, after the page's ``<!-- run -->`` Python blocks above it (the
  quickstart's make its folder and dataset), and its output compared line by line: stdout where it
  succeeds, stderr (its one-line error) where it fails. ``…`` in a line stands for any text (paths,
  figures, a commit id); a line of ``…`` alone for any number of lines.
- **Overview lines**: every ``asyncload ...`` line in a ``bash`` block is parsed by the command's own
  parser, so that a flag a page names and the code does not take fails here; these name buckets and hours
  of training that a test cannot run, and the transcripts run what can be.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from asyncload.tools.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "docs" / "guides" / "cli.md", ROOT / "docs" / "quickstart.md"]
BLOCK = re.compile(r"^(?:<!-- run -->\n)?```(\w+)\n(.*?)^```", re.S | re.M)
ANY = "…"
#: argparse wraps --help at the terminal's width: the pages are written at this one.
COLUMNS = "100"


def blocks(page: Path) -> list[tuple[str, str, bool]]:
    """The page's fenced blocks in order: (language, text, marked ``<!-- run -->``)."""
    return [(m.group(1), m.group(2), m.group(0).startswith("<!--")) for m in BLOCK.finditer(page.read_text())]


def transcripts(text: str) -> list[tuple[str, list[str]]]:
    """``$ command`` lines of a console block, each with the lines it prints."""
    out: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            out.append((line[2:], []))
        elif out:
            out[-1][1].append(line)
    return out


def _pattern(line: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in line.split(ANY)) + r"\Z")


def matches(expected: list[str], got: list[str]) -> bool:
    """``got`` line by line against ``expected`` (``…`` any text; a ``…`` line any lines)."""
    if not expected:
        return not got
    head, rest = expected[0], expected[1:]
    if head.strip() == ANY:
        return any(matches(rest, got[k:]) for k in range(len(got) + 1))
    return bool(got) and bool(_pattern(head).match(got[0])) and matches(rest, got[1:])


def _trimmed(lines: list[str]) -> list[str]:
    while lines and not lines[0].strip():
        lines = lines[1:]
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    return [ln.rstrip() for ln in lines]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("AWS_")}
    return env | {"PYTHONPATH": str(ROOT), "COLUMNS": COLUMNS, "ASYNCLOAD_DEBUG": ""}


def run_page(page: Path, cwd: Path) -> list[str]:
    """Run the page's run blocks and transcripts in order in ``cwd``; the mismatches, described."""
    found: list[str] = []
    todo = blocks(page)
    last = max((k for k, (lang, _, _) in enumerate(todo) if lang == "console"), default=-1)
    for lang, text, runs in todo[: last + 1]:  # (the examples after the last transcript: test_site's)
        if lang == "python" and runs:
            done = subprocess.run([sys.executable, "-c", text], cwd=cwd, env=_env(), capture_output=True, text=True,
                                  timeout=120)  # fmt: skip
            assert done.returncode == 0, f"{page.name}: a run block failed:\n{text}\n{done.stderr[-3000:]}"
        if lang != "console":
            continue
        for command, expected in transcripts(text):
            argv = shlex.split(command)
            assert argv[0] == "asyncload", f"{page.name}: only asyncload commands are run here: {command}"
            done = subprocess.run([sys.executable, "-m", "asyncload", *argv[1:]], cwd=cwd, env=_env(),
                                  capture_output=True, text=True, timeout=150)  # fmt: skip
            got = done.stdout if done.returncode == 0 else done.stderr
            want, lines = _trimmed(expected), _trimmed(got.splitlines())
            if not matches(want, lines):
                found.append(
                    f"{page.relative_to(ROOT)}: `{command}` (exit {done.returncode}) printed:\n" + "\n".join(lines)
                    + "\n--- where the page says:\n" + "\n".join(want) + f"\n--- stderr:\n{done.stderr[-2000:]}"
                )  # fmt: skip
    return found


@pytest.mark.timeout(200)
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_each_command_of_the_page_prints_what_the_page_shows(page: Path, tmp_path: Path) -> None:
    assert any(lang == "console" for lang, _, _ in blocks(page)), f"{page.name} shows no command's output"
    mismatches = run_page(page, tmp_path)
    assert not mismatches, "\n\n".join(mismatches)


def overview_lines() -> list[tuple[str, str]]:
    return [
        (page.name, line.strip())
        for page in PAGES
        for lang, text, _ in blocks(page)
        if lang == "bash"
        for line in text.splitlines()
        if line.strip().startswith("asyncload ")
    ]


def test_every_command_line_of_the_pages_is_taken_by_the_parser() -> None:
    lines = overview_lines()
    assert len(lines) >= 12, lines  # the CLI guide's overview
    parser = build_parser()
    for page, line in lines:
        argv = shlex.split(line, comments=True)[1:]
        try:
            parser.parse_args(argv)
        except SystemExit as exc:  # argparse's answer to an unknown flag or a bad value
            pytest.fail(f"{page}: `{line}` is refused by the parser (exit {exc.code})")


def test_the_matcher_stands_in_for_what_changes_and_nothing_else() -> None:
    assert matches(["wrote 64 rows to file://…/data/seg"], ["wrote 64 rows to file:///tmp/x/data/seg"])
    assert not matches(["wrote 64 rows to file://…/data/seg"], ["wrote 65 rows to file:///tmp/x/data/seg"])
    assert matches(["a", ANY, "z"], ["a", "b", "c", "z"]) and matches(["a", ANY, "z"], ["a", "z"])
    assert not matches(["a", "z"], ["a", "b", "z"]) and not matches(["a"], ["a", "b"])


def test_the_top_level_help_shows_no_markup() -> None:
    """The terminal shows text as it is: no reStructuredText (``double backquotes``), and every flag of
    ``load`` says what it does."""
    env = _env()
    top = subprocess.run([sys.executable, "-m", "asyncload", "--help"], env=env, capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert top.returncode == 0 and "``" not in top.stdout and ":func:" not in top.stdout, top.stdout
    load = build_parser()._subparsers._group_actions[0].choices["load"]  # type: ignore[union-attr]
    silent = [a.option_strings[0] for a in load._actions if a.option_strings and not a.help]
    assert not silent, f"flags of asyncload load without help: {silent}"
