"""The package's import graph: modules, intra-package imports, and any import that runs
upward (closes a cycle).

An import runs upward when the imported module already depends, directly or through
others, on the importing one: the edge lies on a cycle of the graph of module-level and
function-level imports together. A package's ``__init__`` counts as the module it is; imports under ``if TYPE_CHECKING:`` are
type annotations only, and not counted.

Run: ``python -m tools.import_graph [--rev COMMIT] [--package opacus_rc] [--sizes]``:
modules, lines, imports (module level / inside functions) and the upward ones, of the
working tree or of ``COMMIT``'s tree; ``--sizes``: the lines by kind (docstring, comment,
blank, code) and the code tokens.
"""

from __future__ import annotations

import argparse
import ast
import io
import pathlib
import subprocess
import tokenize
from typing import Dict, List, Optional, Set, Tuple

Edge = Tuple[str, str, bool]  # importer, imported, inside a function


def _sources(package: str, rev: Optional[str]) -> Dict[str, str]:
    """Module name -> source of every ``.py`` file under ``package``."""
    if rev:
        listing = ["git", "ls-tree", "-r", "--name-only", rev, package]
        paths = [p for p in subprocess.run(listing, capture_output=True, text=True, check=True).stdout.split() if p.endswith(".py")]
    else:
        paths = sorted(str(p) for p in pathlib.Path(package).rglob("*.py"))
    read = (lambda p: subprocess.run(["git", "show", f"{rev}:{p}"], capture_output=True, text=True, check=True).stdout) if rev else (lambda p: open(p).read())
    return {p[:-3].replace("/", ".").removesuffix(".__init__"): read(p) for p in paths}


def _target(module: str, is_package: bool, node: ast.ImportFrom, name: str, modules: Set[str]) -> Optional[str]:
    """The package module ``from ... import name`` in ``module`` refers to (None: outside)."""
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    for candidate in (f"{source}.{name}", source):
        if candidate in modules:
            return candidate
    return None


def edges(sources: Dict[str, str], packages: Set[str]) -> List[Edge]:
    """Every intra-package import, with whether it sits inside a function."""
    modules, found = set(sources), []
    for module, text in sources.items():
        tree = ast.parse(text)
        inside = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(f)}
        typing_only = {id(n) for f in ast.walk(tree) if isinstance(f, ast.If) and "TYPE_CHECKING" in ast.unparse(f.test) for n in ast.walk(f)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                targets = {_target(module, module in packages, node, a.name, modules) for a in node.names}
            elif isinstance(node, ast.Import):
                targets = {a.name for a in node.names if a.name in modules}
            else:
                continue
            if id(node) in typing_only:
                continue
            found += [(module, t, id(node) in inside) for t in targets if t and t != module]
    return found


def upward(found: List[Edge]) -> List[Edge]:
    """The edges on a cycle: the imported module reaches the importer."""
    graph: Dict[str, Set[str]] = {}
    for a, b, _ in found:
        graph.setdefault(a, set()).add(b)

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(graph.get(node, ()))
        return False

    return [e for e in found if reaches(e[1], e[0])]


_LAYOUT = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)


def sizes(sources: Dict[str, str]) -> Dict[str, int]:
    """Lines of docstrings, comments, blanks and code, and code tokens (every token but
    comments, docstrings, newlines and indentation: a count that layout does not change)."""
    out = dict.fromkeys(("docstring", "comment", "blank", "code", "code_tokens"), 0)
    for text in sources.values():
        lines = text.splitlines()
        docstrings = [
            n.body[0] for n in ast.walk(ast.parse(text))
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)
            and isinstance(n.body[0].value.value, str)
        ]
        starts = {d.lineno for d in docstrings}
        doc = sum(d.end_lineno - d.lineno + 1 for d in docstrings)
        comment = sum(1 for line in lines if line.strip().startswith("#"))
        blank = sum(1 for line in lines if not line.strip())
        out["docstring"] += doc
        out["comment"] += comment
        out["blank"] += blank
        out["code"] += len(lines) - doc - comment - blank
        out["code_tokens"] += sum(
            1 for t in tokenize.generate_tokens(io.StringIO(text).readline)
            if t.type not in _LAYOUT and not (t.type == tokenize.STRING and t.start[0] in starts)
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rev", default=None)
    parser.add_argument("--package", default="opacus_rc")
    parser.add_argument("--sizes", action="store_true", help="also the lines by kind and the code tokens")
    args = parser.parse_args()
    sources = _sources(args.package, args.rev)
    packages = {m for m in sources if any(o.startswith(m + ".") for o in sources)}
    found = edges(sources, packages)
    pairs = {(a, b): f for a, b, f in found}
    up = upward(found)
    lines = sum(len(t.splitlines()) for t in sources.values())
    print(f"{len(sources)} modules, {lines} lines; imports: {sum(not f for f in pairs.values())} module level, "
          f"{sum(pairs.values())} inside functions; upward: {len(up)}")
    for a, b, f in sorted(set(up)):
        print(f"  upward: {a} -> {b}{' (inside a function)' if f else ''}")
    if args.sizes:
        print("  " + ", ".join(f"{k} {v}" for k, v in sizes(sources).items()))


if __name__ == "__main__":
    main()
