"""`what.data`: the raw sources and the curation pipeline each goes through."""

from collections.abc import Iterator
from typing import Any, Literal

from pydantic import Field, PositiveFloat, PositiveInt

from compass.specs.base import NAME_MAX, Issue, Loc, SpecModel, repeats, unused
from compass.specs.sources import SourceUriError, parse_source_uri

SOURCE_NAME = r"^[a-z][a-z0-9_]*$"

FilterName = Literal["gopher_quality", "gopher_repetition", "c4_quality", "fineweb_quality", "regex", "url"]


class FilterSpec(SpecModel):
    """One datatrove filter; `params` go to the filter's constructor and are checked against it."""

    name: FilterName = Field(description="The datatrove filter to apply.")
    params: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the filter's constructor (empty: its defaults).")


class LanguageId(SpecModel):
    """Offline language identification (py3langid): tag every document, optionally drop the others."""

    keep: list[str] = Field(default_factory=list, description="ISO 639-1 codes to keep; empty keeps all.")
    min_score: float = Field(default=0.0, ge=0, le=1, description="Drop documents below this confidence.")


class MinhashSpec(SpecModel):
    """MinHash near-duplicate removal (datatrove): ~ Jaccard threshold set by buckets x hashes."""

    n_grams: PositiveInt = Field(default=5, description="Words per shingle (the n-grams documents are compared on).")
    num_buckets: PositiveInt = Field(
        default=14, description="Buckets of hashes: documents whose hashes all match in any one bucket are "
                                "near-duplicates (more buckets catch less similar pairs).")
    hashes_per_bucket: PositiveInt = Field(
        default=8, description="Hashes per bucket (more make a bucket match stricter).")


class Curation(SpecModel):
    """The pipeline a source goes through, in this order: filters, language id, exact dedup, MinHash."""

    filters: list[FilterSpec] = Field(default_factory=list, description="datatrove filters, applied first and in "
                                                                        "order.")
    language_id: LanguageId | None = Field(default=None, description="Language identification (None: none).")
    exact_dedup: bool = Field(
        default=True, description="Remove documents whose text exactly repeats another's, keeping one copy.")
    minhash: MinhashSpec | None = Field(default=None, description="Near-duplicate removal (None: none).")
    heldout_fraction: float = Field(
        default=0.05, ge=0, lt=0.5, description="Documents kept aside (by a hash of the document, or of the page or "
        "file its sections come from, so a page is never on both sides) for held-out measurement."
    )


HeldoutUnit = Literal["document", "file", "page"]  # what falls on one side of the held-out split whole


class DataSource(SpecModel):
    """A raw source: a local folder, an s3:// prefix, or an offline package (deb://, pypi://, stdlib://)."""

    name: str = Field(max_length=NAME_MAX, pattern=SOURCE_NAME,
                      description="Identifier used by mixtures (lower_snake_case).")
    uri: str = Field(
        min_length=1,
        description="Local path, s3://bucket/prefix, deb://PACKAGE, pypi://NAME==VERSION or stdlib://.",
    )
    include: list[str] = Field(default_factory=lambda: ["**/*"], description="Glob patterns inside the source.")
    exclude: list[str] = Field(
        default_factory=list, description="Glob patterns of files to leave out, matched against their paths inside "
                                          "the source.")
    format: Literal["jsonl", "parquet", "text", "html", "code", "warc"] = Field(
        default="text", description="How files are read: jsonl/parquet records (the text_key column), plain text, "
                                    "html (its text extracted), code (each file as it is), or warc (web "
                                    "archives, .warc or .warc.gz: each HTML response's text, with its URL).")
    text_key: str = Field(default="text", description="jsonl/parquet: the column holding the text.")
    split: Literal["file", "sections"] = Field(
        default="file", description="One document per file, or per section (html headings, text paragraphs)."
    )
    section_chars: PositiveInt = Field(default=4000, description="sections: target characters per document.")
    language: str | None = Field(default=None, description="ISO 639-1 code, if the whole source is one language.")
    domain: str = Field(default="web", description="Domain tag: web, code, docs, books, math, ...")
    max_documents: PositiveInt | None = Field(default=None, description="Cap, taken in a stable order.")
    max_document_chars: PositiveInt = Field(
        default=2_000_000, le=100_000_000,
        description="Longer documents are dropped and counted (a dump or a minified bundle is no training text); "
                    "files and JSONL lines are read with a matching byte cap, so memory follows this cap.")
    curation: Curation = Field(default=Curation(), description="The curation pipeline this source goes through.")
    listing: str | None = Field(
        default=None, description="Filled in by compass when it loads the spec (never written by hand): for a "
        "local folder, a digest of the selected files' paths, sizes and modification times (or sha256: "
        "how.storage.input_stamps); for an s3:// prefix, of its objects' keys, sizes and ETags. It is part of the "
        "ingest step's identity, so an edited, added or removed file ingests the source again.")
    max_epochs: PositiveFloat = Field(
        default=4.0, description="How many times training may read this source over all its stages (pretraining, "
        "long context): `compass plan` flags a mixture that draws more (repeating data stops helping after a few "
        "epochs; small high-quality sources are the ones worth repeating).")


class Data(SpecModel):
    """The raw sources the run reads; each is ingested and curated on its own, and mixtures name them."""

    sources: list[DataSource] = Field(default_factory=list,
                                      description="The raw sources (at least one when training from random weights).")


def data_rules(data: Data, at: Loc = ("what", "data")) -> Iterator[Issue]:
    """Rules inside what.data: unique names, URIs that parse, fields that apply to each source's format, patterns
    that stay inside their source."""
    sources = data.sources
    for i, dup in repeats([s.name for s in sources]):
        yield Issue((*at, "sources", i, "name"), f"source name '{dup}' is used twice",
                    "give every source its own name")
    for i, src in enumerate(sources):
        where = (*at, "sources", i)
        try:
            uri = parse_source_uri(src.uri)
        except SourceUriError as exc:
            yield Issue((*where, "uri"), str(exc), exc.hint)
            continue
        if src.format in ("jsonl", "parquet", "warc") and uri.scheme in ("deb", "stdlib"):
            yield Issue((*where, "format"), f"format {src.format} does not fit a {uri.scheme}:// source",
                        "packages hold text, html or code files")
        yield from unused(src, "text_key", where, src.format in ("jsonl", "parquet"),
                           "only jsonl and parquet records have keys")
        yield from unused(src, "section_chars", where, src.split == "sections", "only split: sections cuts sections")
        for field in ("include", "exclude"):
            for j, pattern in enumerate(getattr(src, field)):
                if _escapes(pattern):
                    yield Issue((*where, field, j), f"pattern '{pattern}' reaches outside the source's folder",
                                "patterns are relative to the source: no leading '/', no '..' segments")


def _escapes(path: str) -> bool:
    """Whether a path relative to a root could leave it (absolute, or a '..' segment)."""
    return path.startswith(("/", "\\", "~")) or ".." in path.replace("\\", "/").split("/")
