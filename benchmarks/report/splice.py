"""Splicing generated blocks between the bench:<name> markers of a Markdown file."""

from __future__ import annotations


def splice(text: str, name: str, block: list[str]) -> str | None:
    """`text` with the lines between its bench:<name> markers replaced by `block`; None if the
    markers are missing."""
    begin, end = f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < i:
        return None
    return text[: i + len(begin)] + "\n" + "\n".join(block) + "\n" + text[j:]


def update_readme(path: str, block: list[str], name: str = "headline") -> bool:
    """Replaces the text between the bench:<name> markers of README.md; False if they are
    missing."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return False
    new = splice(text, name, block)
    if new is None:
        return False
    if new != text:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    return True
