"""What a TRL step's attention holds at its real length (issue 73, H3): packed SFT rows run compass's document
attention, which builds no [L, L] mask; where transformers still builds one (padded rows on SDPA or eager, packed
rows on eager), the memory estimate counts it: at the SmolLM3 example's 64k tokens, 4 GiB a row as bools."""

from __future__ import annotations

from compass.specs import costs
from compass.specs.loader import load_spec
from tests.conftest import REPO

LENGTH = 65536  # the example's SFT max_length


def sft_memory(spec, **changes):
    """The example's SFT step's estimate, its section or `how` changed."""
    how_changes = {k: changes.pop(k) for k in ("attention",) if k in changes}
    post = [p.model_copy(update=changes) if p.name == "sft" else p for p in spec.what.post_training]
    what = spec.what.model_copy(update={"post_training": post})
    how = spec.how.model_copy(update=how_changes)
    changed = spec.model_copy(update={"what": what, "how": how})
    (sft,) = [m for m in costs.library_step_memory(changed) if m.step == "post_train:sft"]
    return sft


def test_packed_sft_holds_no_dense_mask_and_a_mask_that_remains_is_counted():
    spec = load_spec(REPO / "specs" / "examples" / "smollm3-3b.yaml").spec
    packed = sft_memory(spec)
    assert packed.length == LENGTH and packed.micro_batch == 1
    padded = sft_memory(spec, packing=False)
    assert padded.activations - packed.activations == LENGTH * LENGTH  # one row's bool mask: 4 GiB
    eager = sft_memory(spec, attention="eager")  # transformers' eager builds its float mask from the position ids
    assert eager.activations - packed.activations == LENGTH * LENGTH * 2  # bf16 on the H100s
    flash = sft_memory(spec, packing=False, attention="flash")  # flash takes no mask, padded or not
    assert flash.activations == packed.activations
    assert costs.dense_mask_bytes("auto", packed=True, rows=3, length=LENGTH, act_bytes=2) == 0
