"""Writing a benchmark's section of docs/benchmarks.md, leaving the others as they are."""

from __future__ import annotations

from pathlib import Path


def replace_section(doc: Path, heading: str, lines: list[str]) -> None:
    """Put `lines` (starting with `heading`) in place of the section `heading`
    opens, up to the next ``## `` heading; append it if there is none yet."""
    text = doc.read_text()
    if heading in text:
        head, _, rest = text.partition(heading)
        tail = rest.split("\n## ", 1)
        text = head + "\n".join(lines) + ("\n## " + tail[1] if len(tail) > 1 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + "\n".join(lines)
    doc.write_text(text)
