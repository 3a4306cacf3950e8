"""Splicing generated blocks between the bench:<name> markers of a Markdown file."""

from __future__ import annotations


def update_readme(path: str, block: list[str], name: str = "headline") -> bool:
    """Replaces the text between the bench:<name> markers of README.md; False if they are missing."""
    begin, end = f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return False
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < i:
        return False
    new = text[: i + len(begin)] + "\n" + "\n".join(block) + "\n" + text[j:]
    if new != text:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    return True
