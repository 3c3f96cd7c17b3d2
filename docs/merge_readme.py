"""Rebuild README.md's per-area part from docs/sections/*.md (run from the repository root).

README.md = its hand-written head (everything up to the line after "and the full measured tables.")
+ each section in ORDER with its headings moved one level down, separated by one blank line.
    python3 docs/merge_readme.py [--check]
"""
import pathlib
import re
import sys

ORDER = ["foundation", "w4a8_fp8", "w4a8_int8", "lut", "attention_prefill", "kv4", "mla", "model"]
MARKER = "and the full measured tables.\n"


def build(root: pathlib.Path) -> str:
    readme = (root / "README.md").read_text()
    head = readme[: readme.index(MARKER) + len(MARKER)] + "\n\n"
    parts = []
    for name in ORDER:
        text = (root / "docs" / "sections" / f"{name}.md").read_text()
        out, fenced = [], False
        for line in text.splitlines(keepends=True):
            if line.startswith("```"):
                fenced = not fenced
            out.append(re.sub(r"^(#+) ", r"#\1 ", line) if not fenced else line)
        parts.append("".join(out).rstrip("\n") + "\n")
    return head + "\n".join(parts)


if __name__ == "__main__":
    root = pathlib.Path(".")
    new = build(root)
    if "--check" in sys.argv:
        sys.exit(0 if new == (root / "README.md").read_text() else 1)
    (root / "README.md").write_text(new)
