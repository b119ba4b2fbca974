"""Decontamination throughput: compass's fence against datatrove's own n-gram decontamination, the same work.

Both index the same benchmark items (MMLU and HellaSwag as compass prepares them: each item's question and gold
answer; 13-word n-grams of the question and of question-into-gold) and scan the same documents: pages of real
offline text (Shakespeare and the Debian reference), a share of them with a benchmark item planted inside.
datatrove's side is its NGramsDecontIndexer's hashing (its run() reads benchmarks through a lighteval API that
lighteval 0.13 no longer has, so the items are hashed by its own compute_hashes and saved as run() saves them) and
its NGramsDecontFilter; compass's is tasks/data/decontamination.py (Fence, Matcher), what the decontaminate step and the
`remove` filter run. Each variant runs in its own process; the measure is pages scanned per second (the index's
build time is reported apart), and each variant's count of planted pages found.

    python benchmarks/decontamination_throughput.py [--pages 4000] [--planted 200] [--rounds 3] [--items N]

(`--items N` indexes each benchmark's first N items only: the suite's check of this script, not a measure.)
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import tempfile
import time
from pathlib import Path

from harness import child, interleave, note, report, write_result

REPO = Path(__file__).resolve().parent.parent
N_GRAMS = 13
BENCHMARKS = ("mmlu", "hellaswag")


def corpus(pages: int, planted: int, limit: int | None, seed: int = 0) -> tuple[list[str], set[int]]:
    """`pages` pages of real text, `planted` of them (their indexes returned) with a benchmark item inside."""
    sys.path.insert(0, str(REPO))  # the suite's offline text helpers
    from tests.offline_text import clean_documents
    from tests.offline_text import planted as plant

    rng = random.Random(seed)
    documents = clean_documents()
    documents = [documents[i % len(documents)] for i in range(pages)]  # the corpus repeated to size
    indexed = items(limit)
    leaks = set(rng.sample(range(pages), planted))
    return [plant(d, rng.choice(indexed), rng) if k in leaks else d for k, d in enumerate(documents)], leaks


def items(limit: int | None) -> list:
    from compass.specs.evaluation import Benchmark
    from compass.tasks.evaluation.benchmark_items import items_of

    return [i for name in BENCHMARKS for i in itertools.islice(items_of(Benchmark(name=name)), limit)]


def compass_fence(documents: list[str], limit: int | None) -> tuple[float, float, set[int]]:
    """(index seconds, scan seconds, pages matched) with compass's fence."""
    from compass.tasks.data.decontamination import Fence, Matcher

    start = time.perf_counter()
    matcher = Matcher(Fence.build(items(limit), N_GRAMS))
    built = time.perf_counter()
    found = {k for k, d in enumerate(documents) if matcher.match(d) is not None}
    return built - start, time.perf_counter() - built, found


def datatrove_decont(documents: list[str], limit: int | None, work: Path) -> tuple[float, float, set[int]]:
    """(index seconds, scan seconds, pages matched) with datatrove's NGramsDecontIndexer and NGramsDecontFilter."""
    import numpy as np
    from datatrove.data import Document
    from datatrove.pipeline.decont import NGramsDecontConfig, NGramsDecontFilter, NGramsDecontIndexer

    config = NGramsDecontConfig(n_grams=N_GRAMS, find_query_ngrams=True, find_overlap_ngrams=True)
    start = time.perf_counter()
    indexer = NGramsDecontIndexer(str(work / "index"), lighteval_tasks=[], config=config)
    # its run() as written, less the lighteval registry call (an API lighteval 0.13 no longer has): the items'
    # hashes by the indexer's own compute_hashes, saved per task the way run() saves them
    hashes: dict[str, set[int]] = {}
    for item in items(limit):
        hashes.setdefault(item.benchmark, set()).update(indexer.compute_hashes(item.golds[0], item.query))
    (work / "index").mkdir(parents=True, exist_ok=True)
    for task, task_hashes in hashes.items():
        np.array(sorted(task_hashes), dtype=config.hash_config.np_descr).tofile(work / "index" /
                                                                                 f"{task}.index.hashes")
    built = time.perf_counter()
    decont = NGramsDecontFilter(str(work / "index"), config=config)
    found = {k for k, d in enumerate(documents) if decont.filter(Document(text=d, id=str(k))) is not True}
    return built - start, time.perf_counter() - built, found


def run_child(variant: str, pages: int, planted: int, limit: int | None, out: str) -> None:
    from harness import peak_rss_mib

    documents, leaks = corpus(pages, planted, limit)
    with tempfile.TemporaryDirectory(prefix="compass-decont-") as tmp:
        index_s, scan_s, found = (compass_fence(documents, limit) if variant == "compass"
                                  else datatrove_decont(documents, limit, Path(tmp)))
    write_result(out, pages / scan_s, peak_mib=peak_rss_mib(), index_s=index_s,
                 recall=len(found & leaks) / len(leaks), flagged_clean=len(found - leaks))


VARIANTS = {"datatrove NGramsDecont": "datatrove", "compass fence": "compass"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=4000)
    parser.add_argument("--planted", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--items", type=int, default=0, help="each benchmark's first N items (0: all)")
    parser.add_argument("--child", nargs=5, metavar=("VARIANT", "PAGES", "PLANTED", "ITEMS", "OUT"))
    args = parser.parse_args()
    if args.child:
        variant, pages, planted, limit, out = args.child
        run_child(variant, int(pages), int(planted), int(limit) or None, out)
        return
    script = str(Path(__file__).resolve())
    results = interleave({label: (lambda v=v: child(script, [v, str(args.pages), str(args.planted), str(args.items)]))
                          for label, v in VARIANTS.items()}, args.rounds)
    which = f"the first {args.items} items of each of {'+'.join(BENCHMARKS)}" if args.items else \
        f"{'+'.join(BENCHMARKS)} items"
    report(f"decontamination: {which} indexed as {N_GRAMS}-grams, {args.pages} pages of real "
           f"text scanned ({args.planted} with an item planted)", results, "datatrove NGramsDecont", "pages/s")
    for label, runs in results.items():
        last = runs[-1].details
        note(f"{label}: index built in {last['index_s']:.1f} s; planted pages found {last['recall']:.1%}, clean pages "
             f"flagged {last['flagged_clean']}")


if __name__ == "__main__":
    main()
