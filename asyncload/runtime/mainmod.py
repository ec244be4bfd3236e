"""Whether a new process can find what a pickle takes from the user's ``__main__``.

Why: a reader or fan-out process unpickles its source and options, and a class or function defined in the
training script is pickled by reference, as ``__main__.Name``. A spawned process finds it only by running
the script's file again as ``__mp_main__``, so it cannot when there is no file (``python -c``, a REPL, a
notebook), nor when the name is bound only under ``if __name__ == "__main__":``. Unchecked, such a process
dies unpickling (``AttributeError: Can't get attribute 'Old' on <module '__main__'>``) and the loader saw a
row that killed its reader. The check reads the pickle's opcodes and the script's syntax tree: nothing is
unpickled or run.
"""

from __future__ import annotations

import ast
import pickletools
import sys
from pathlib import Path


def main_names(pickled: bytes) -> list[str]:
    """The names the pickle looks up in ``__main__``, in order of first use."""
    names: list[str] = []
    memo: dict[int, object] = {}
    strings: list[object] = []  # what the opcodes pushed most recently (module and name for STACK_GLOBAL)
    for op, arg, _ in pickletools.genops(pickled):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
            strings.append(arg)
        elif op.name == "MEMOIZE":
            memo[len(memo)] = strings[-1] if strings else None
        elif op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[int(arg)] = strings[-1] if strings else None
        elif op.name in ("GET", "BINGET", "LONG_BINGET"):
            strings.append(memo.get(int(arg)))
        elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
            module, name = strings[-2], strings[-1]
            if module == "__main__" and isinstance(name, str) and name not in names:
                names.append(name)
            strings.append(None)  # the global itself
        elif op.name == "GLOBAL" and isinstance(arg, str):
            module, _, name = arg.partition(" ")
            if module == "__main__" and name not in names:
                names.append(name)
        else:
            strings.append(None)
    return names


def _guarded(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either way round): a block a new process does not run."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides) and any(
        isinstance(s, ast.Constant) and s.value == "__main__" for s in sides
    )


def _bound(body: list[ast.stmt], out: set[str]) -> None:
    """Names bound when ``body`` runs as an imported module (not under a ``__main__`` guard)."""
    for node in body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            out.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            out.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                out.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.If):
            if not _guarded(node.test):
                _bound(node.body, out)
                _bound(node.orelse, out)
        elif isinstance(node, ast.Try | ast.With | ast.For | ast.While):
            for part in ("body", "orelse", "finalbody"):
                _bound(getattr(node, part, []), out)
            for handler in getattr(node, "handlers", []):
                _bound(handler.body, out)


def _runs_at_import(body: list[ast.stmt]) -> int | None:
    """The line of the first statement that does work when the module is imported (a call, a loop, a
    ``with``) outside a ``__main__`` guard; None for a script of definitions and a guarded main."""
    for node in body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call | ast.Await):
            return node.lineno
        if isinstance(node, ast.For | ast.AsyncFor | ast.While | ast.With | ast.AsyncWith):
            return node.lineno
        if isinstance(node, ast.If) and not _guarded(node.test):
            if (line := _runs_at_import(node.body)) or (line := _runs_at_import(node.orelse)):
                return line
    return None


def unreachable_from_main(pickled: bytes) -> tuple[list[str], str, str] | None:
    """The names of ``__main__`` a new process could not find, why, and what to do (one clause each); None
    where it finds them all."""
    names = main_names(pickled)
    if not names:
        return None
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not Path(path).is_file():
        why = "the script has no file a new process could import (python -c, an interactive session or a notebook)"
        return names, why, _define_in_a_module(names)
    try:
        tree = ast.parse(Path(path).read_bytes(), filename=path)
    except (OSError, SyntaxError, ValueError) as exc:
        return names, f"{path} cannot be read again ({type(exc).__name__}: {exc})", _define_in_a_module(names)
    if runs := _runs_at_import(tree.body):
        why = (
            f"{path} runs its work at its top level (line {runs}), with no 'if __name__ == \"__main__\":' guard: "
            "a new process that imports it would start that work again"
        )
        return names, why, "put the script's work under 'if __name__ == \"__main__\":'"
    bound: set[str] = set()
    _bound(tree.body, bound)
    missing = [n for n in names if n not in bound]
    if not missing:
        return None
    why = (
        f"{path} does not define {', '.join(missing)} at its top level (a definition under "
        "'if __name__ == \"__main__\":' or inside a function is not run in a new process)"
    )
    return missing, why, _define_in_a_module(missing)


def _define_in_a_module(names: list[str]) -> str:
    return f"define {', '.join(names)} in a module (a .py file the script imports) so that a new process can import it"
