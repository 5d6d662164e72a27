"""Chat SFT conversations mined from the standard-library corpus (data.stdlib_corpus) with `ast`, fully offline.

Each conversation is a list of {"role": "user"|"assistant", "content": str} messages, alternating and starting with a
user turn. Kinds (every one grounded in real source, nothing invented):
    write     "Write `func(sig)` from `module`: <docstring summary>"  ->  the function's dedented source
    explain   "What does `module.qualname` do?"                      ->  its cleaned docstring
    class     "Write the method `Class.meth(sig)` ...: <summary>"    ->  method source, then up to two follow-ups
              "Now write `other(sig)`: <summary>"                    ->  that method's source (same class)
Functions and classes without a docstring of `MIN_DOC_CHARS`..`MAX_DOC_CHARS` characters or with a source over
`MAX_SOURCE_CHARS` are skipped. Conversations of one file keep source order; files come in corpus order, so the list is
deterministic. The split is the corpus split (by file), so no validation source leaks into train conversations.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import warnings
from pathlib import Path

from data.stdlib_corpus import corpus_files, read_source, stdlib_root

Conversation = list[dict[str, str]]

MAX_SOURCE_CHARS = 1200
MAX_DOC_CHARS = 600
MIN_DOC_CHARS = 12
MAX_SUMMARY_CHARS = 200
MAX_FOLLOW_UPS = 2
FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef


def stdlib_conversations(split: str, root: Path | None = None, limit: int | None = None) -> list[Conversation]:
    """The conversations mined from the `split` files of the corpus, in corpus order; `limit` keeps the first ones
    (and stops parsing early)."""
    root = stdlib_root() if root is None else Path(root)
    conversations: list[Conversation] = []
    for path in corpus_files(split, root):
        if limit is not None and len(conversations) >= limit:
            break
        conversations.extend(file_conversations(read_source(path), module_name(path.relative_to(root))))
    return conversations if limit is None else conversations[:limit]


def module_name(relative_path: Path) -> str:
    """Dotted module name of a stdlib file: `email/mime/text.py` -> `email.mime.text`, `json/__init__.py` -> `json`."""
    parts = list(relative_path.with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def file_conversations(source: str, module: str) -> list[Conversation]:
    """Conversations for one module's source; a file that does not parse yields none."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)  # invalid escapes in old stdlib strings
            tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines()
    conversations: list[Conversation] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            conversations.extend(_function_conversations(node, lines, module))
        elif isinstance(node, ast.ClassDef):
            conversations.extend(_class_conversations(node, lines, module))
    return conversations


def _function_conversations(node: FunctionNode, lines: list[str], module: str) -> list[Conversation]:
    doc = _docstring(node)
    code = _source(node, lines)
    if doc is None or code is None:
        return []
    write = [_user(f"Write `{_signature(node)}` from `{module}`: {_summary(doc)}"), _assistant(code)]
    explain = [_user(f"What does `{module}.{node.name}` do?"), _assistant(doc)]
    return [write, explain]


def _class_conversations(node: ast.ClassDef, lines: list[str], module: str) -> list[Conversation]:
    conversations: list[Conversation] = []
    class_doc = _docstring(node)
    if class_doc is not None:
        conversations.append([_user(f"What does the class `{module}.{node.name}` do?"), _assistant(class_doc)])
    methods = []
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            doc, code = _docstring(item), _source(item, lines)
            if doc is not None and code is not None:
                methods.append((item, doc, code))
    # Chunks of 1 + MAX_FOLLOW_UPS methods, each chunk one multi-turn conversation in source order.
    chunk = 1 + MAX_FOLLOW_UPS
    for start in range(0, len(methods), chunk):
        first, *rest = methods[start : start + chunk]
        method, doc, code = first
        messages = [
            _user(f"Write the method `{node.name}.{_signature(method)}` of `{module}.{node.name}`: {_summary(doc)}"),
            _assistant(code),
        ]
        for method, doc, code in rest:
            messages += [_user(f"Now write `{_signature(method)}`: {_summary(doc)}"), _assistant(code)]
        conversations.append(messages)
    return conversations


def _docstring(node: FunctionNode | ast.ClassDef) -> str | None:
    doc = ast.get_docstring(node, clean=False)
    if not doc:
        return None
    doc = inspect.cleandoc(doc).strip()
    return doc if MIN_DOC_CHARS <= len(doc) <= MAX_DOC_CHARS else None


def _summary(doc: str) -> str:
    """First paragraph of a docstring on one line, cut at a word boundary."""
    paragraph = " ".join(doc.split("\n\n", 1)[0].split())
    if len(paragraph) <= MAX_SUMMARY_CHARS:
        return paragraph
    return paragraph[:MAX_SUMMARY_CHARS].rsplit(" ", 1)[0] + " ..."


def _source(node: FunctionNode, lines: list[str]) -> str | None:
    """Dedented source of a def, decorators included; None when over MAX_SOURCE_CHARS."""
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    code = textwrap.dedent("\n".join(lines[first - 1 : node.end_lineno])).strip("\n")
    return code if len(code) <= MAX_SOURCE_CHARS else None


def _signature(node: FunctionNode) -> str:
    return f"{node.name}({ast.unparse(node.args)})"


def _user(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


def _assistant(content: str) -> dict[str, str]:
    return {"role": "assistant", "content": content}
