"""Peak memory of the loss alone (forward and backward) at a 128k vocabulary: compass's chunked cross-entropy
against the full fp32 logits of the previous core, for 16k tokens of hidden size 256. Each variant runs in its
own process; the figure is the max RSS above the RSS once hidden states and head are in memory.

    python benchmarks/loss_memory.py [--tokens 16384] [--vocab 128256] [--hidden 256] [--rounds 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from harness import child, current_rss_mib, interleave, note, peak_rss_mib, pin_threads, report, write_result


def loss_memory(variant: str, tokens: int, vocab: int, hidden: int) -> tuple[float, float]:
    import torch

    from compass.model.loss import chunked_lm_loss, lm_loss

    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    states = torch.randn(1, tokens, hidden, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    before = current_rss_mib()
    start = time.perf_counter()
    if variant == "chunked":
        loss, _ = chunked_lm_loss(states, labels, head, 1e-4)
    else:
        loss, _ = lm_loss(head(states), labels, 1e-4)
    loss.backward()
    return peak_rss_mib() - before, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="8192,16384")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        pin_threads()
        variant, tokens, vocab, hidden, out = args.child
        mib, seconds = loss_memory(variant, int(tokens), int(vocab), int(hidden))
        write_result(out, mib, seconds=seconds, peak_mib=peak_rss_mib())
        return
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for tokens in (int(n) for n in args.tokens.split(",")):
        needs = 3 * tokens * args.vocab * 4  # logits, their log-softmax and their gradient, fp32
        shape = [str(tokens), str(args.vocab), str(args.hidden)]
        title = (f"loss memory: {tokens:,} tokens, vocabulary {args.vocab:,}, hidden {args.hidden} (fp32 logits of "
                 f"the batch: {tokens * args.vocab * 4 / 2**30:.1f} GiB)")
        if needs > 0.8 * ram:
            run = interleave({"chunked": lambda s=shape: child(__file__, ["chunked", *s])}, args.rounds)["chunked"]
            report(title, {"chunked": run}, "chunked", "MiB above the inputs", higher_is_better=False,
                   notes=[f"full fp32 logits: not run, estimated (not measured) to need ~{needs / 2**30:.0f} GiB, "
                          f"more than this machine's {ram / 2**30:.0f} GiB: "
                          f"{needs / 2**20 / statistics.median(r.value for r in run):.0f}x what chunked took"])
            continue
        results = interleave({v: (lambda v=v, s=shape: child(__file__, [v, *s]))
                              for v in ("full fp32 logits", "chunked")}, args.rounds)
        seconds = {k: statistics.median(r.details["seconds"] for r in v) for k, v in results.items()}
        ratios = report(title, results, "full fp32 logits", "MiB above the inputs", higher_is_better=False,
                        notes=["seconds (median): " + ", ".join(f"{k} {s:.1f}" for k, s in seconds.items())])
        note(f"chunked needs {1 / ratios['chunked']:.1f}x less memory for the loss (goal >= 4x)")


if __name__ == "__main__":
    main()
