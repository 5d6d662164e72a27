"""A summarisation-like prompt set in MT-bench format: every prompt quotes a passage the answer can copy from.

Copying from the prompt is where retrieval drafters (prompt lookup, lookahead) shine, so `python -m inference bench`
reports them on this set next to MT-bench. Two categories:
    quote-code  a function from the stdlib validation split (the tiny target's own domain), to be repeated with a
                docstring: "Here is `mod.func`: ```...``` Rewrite it with a docstring."
    quote-text  a WikiText-2 passage from ../shared/data (skipped when absent), to be summarised.

    python scripts/quote_prompts.py --out quote_prompts.jsonl [--per-category 20]
    python -m inference bench --drafter prompt_lookup --base builtin:tiny --questions quote_prompts.jsonl
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data.stdlib_corpus import corpus_files, read_source  # noqa: E402

WIKITEXT = ROOT.parent / "shared" / "data" / "wikitext2_pytorch_examples" / "valid.txt"
MAX_CHARS = 900  # passages stay well inside the tiny target's 512-token chat context


def code_prompts(n: int) -> list[str]:
    """Functions or methods of 4-25 lines from the stdlib validation split, in corpus order, one per file."""
    prompts = []
    for path in corpus_files("validation"):
        source = read_source(path)
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):  # module functions and methods, outermost first
            if isinstance(node, ast.FunctionDef) and 4 <= node.end_lineno - node.lineno + 1 <= 25:
                code = textwrap.dedent("\n".join(source.splitlines()[node.lineno - 1 : node.end_lineno]))
                if code and len(code) <= MAX_CHARS:
                    prompts.append(f"Here is `{path.stem}.{node.name}`:\n```\n{code}\n```\nRewrite it with a docstring.")
                    break
        if len(prompts) == n:
            break
    return prompts


def text_prompts(n: int, path: Path = WIKITEXT) -> list[str]:
    """WikiText-2 paragraphs of 300-900 characters, to be summarised."""
    if not path.is_file():
        return []
    paragraphs = [p.strip() for p in path.read_text(encoding="utf-8").split("\n") if not p.strip().startswith("=")]
    chosen = [p for p in paragraphs if 300 <= len(p) <= MAX_CHARS][:n]
    return [f"Summarize this passage:\n\n{p}" for p in chosen]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--per-category", type=int, default=20)
    args = p.parse_args(argv)
    rows = [("quote-code", q) for q in code_prompts(args.per_category)]
    rows += [("quote-text", q) for q in text_prompts(args.per_category)]
    with open(args.out, "w", encoding="utf-8") as f:
        for i, (category, question) in enumerate(rows, start=1):
            f.write(json.dumps({"question_id": i, "category": category, "turns": [question]}) + "\n")
    counts = {c: sum(r[0] == c for r in rows) for c in ("quote-code", "quote-text")}
    print(f"{args.out}: " + ", ".join(f"{n} {c}" for c, n in counts.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
