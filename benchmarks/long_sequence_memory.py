"""Peak memory of one training step (forward, backward, optimizer) of a small SmolLM3-shaped model at 1k, 2k, 4k
and 8k tokens per row, every row packed with documents of ~300 tokens: compass's training core (per-document
SDPA, chunked loss) against the previous one (a dense fp32 [B, 1, L, L] block-diagonal mask handed to SDPA, and
the loss on full fp32 logits), one change at a time: the dense mask with the chunked loss in between. Memory
should grow linearly with the row (8x from 1k to 8k); the dense mask grows with its square. Each point is a fresh
process; the step's peak is its max RSS minus the RSS before the step.

    python benchmarks/long_sequence_memory.py [--lengths 1024,2048,4096,8192] [--rows 2] [--rounds 1]
"""

from __future__ import annotations

import argparse
import statistics

from harness import Run, child, current_rss_mib, interleave, note, peak_rss_mib, pin_threads, report, write_result

VOCAB = 8192
DOCUMENT = 300
PREVIOUS, CHUNKED_DENSE, COMPASS = "dense mask, full logits", "dense mask, chunked loss", "compass"


def step_memory(variant: str, length: int, rows: int) -> float:
    import numpy as np
    import torch

    from compass.model.architecture import build_model, hf_config
    from compass.model.attention import DOCUMENT_SDPA
    from compass.model.lm import CausalLMWithLoss
    from compass.model.loss import chunked_lm_loss, lm_loss
    from compass.model.training.packing import make_batch
    from compass.specs.architecture import Architecture

    arch = Architecture(num_layers=4, hidden_size=256, ffn_size=768, num_heads=8, num_kv_heads=2,
                        positions={"kind": "rnope", "nope_every": 4}, vocab_size=VOCAB)
    special = {"bos": 0, "eos": 0, "pad": 1}
    model = build_model(hf_config(arch, VOCAB, special, length), 0, DOCUMENT_SDPA if variant == "compass" else "sdpa")
    lm = CausalLMWithLoss(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = np.random.default_rng(0)
    tokens = rng.integers(2, VOCAB, (rows, length))
    segments = np.tile(np.arange(length) // DOCUMENT, (rows, 1))
    batch = make_batch(tokens, segments)
    before = current_rss_mib()
    if variant == "compass":
        loss, _ = lm(**batch.inputs(torch.device("cpu")))
    elif variant == CHUNKED_DENSE:  # the dense mask, compass's chunked loss: the loss changed alone
        hidden = model.model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                             attention_mask=batch.dense_mask(), use_cache=False).last_hidden_state
        loss, _ = chunked_lm_loss(hidden, batch.labels, model.get_output_embeddings(), 0.0)
    else:  # the dense additive mask the previous core built, and full fp32 logits
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=batch.dense_mask(),
                       use_cache=False).logits
        loss, _ = lm_loss(logits, batch.labels, 0.0)
    loss.backward()
    opt.step()
    return peak_rss_mib() - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        pin_threads()
        variant, length, rows, out = args.child
        write_result(out, step_memory(variant, int(length), int(rows)), peak_mib=peak_rss_mib())
        return
    lengths = [int(x) for x in args.lengths.split(",")]
    variants = {f"{v} @ {n}": (lambda v=v, n=n: child(__file__, [v, str(n), str(args.rows)]))
                for n in lengths for v in (PREVIOUS, CHUNKED_DENSE, COMPASS)}
    results: dict[str, list[Run]] = interleave(variants, args.rounds)
    medians = {k: statistics.median(r.value for r in v) for k, v in results.items()}
    for n in lengths:
        report(f"peak memory of one training step at {n} tokens/row: 4 layers, hidden 256, vocab {VOCAB}, "
               f"{args.rows} rows of documents of {DOCUMENT} tokens, fp32 CPU; MiB above the process before the step",
               {v: results[f"{v} @ {n}"] for v in (PREVIOUS, CHUNKED_DENSE, COMPASS)}, PREVIOUS, "MiB",
               higher_is_better=False)
    first, last = lengths[0], lengths[-1]
    growth = {v: medians[f"{v} @ {last}"] / medians[f"{v} @ {first}"] for v in (COMPASS, CHUNKED_DENSE, PREVIOUS)}
    note(f"growth {first} -> {last} tokens ({last // first}x longer): compass {growth[COMPASS]:.1f}x (goal <= "
         f"{12 * last / first / 8:.1f}x), {CHUNKED_DENSE} {growth[CHUNKED_DENSE]:.1f}x, {PREVIOUS} "
         f"{growth[PREVIOUS]:.1f}x")


if __name__ == "__main__":
    main()
