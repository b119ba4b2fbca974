"""`what.tokenizer`: candidate tokenizers and the rule that picks one."""

from typing import Annotated, Literal

from pydantic import Field, PositiveInt

from compass.specs.base import NAME_MAX, SpecModel
from compass.specs.file_stamp import FileStamp


class BpeCandidate(SpecModel):
    """A byte-level BPE trained on the curated training split."""

    kind: Literal["bpe"]
    vocab_size: PositiveInt = Field(ge=260, description="Includes the 256 byte symbols and special tokens.")
    min_frequency: PositiveInt = Field(
        default=2, description="A pair seen fewer times than this in the training text is not merged.")

    @property
    def key(self) -> str:
        """The candidate's name in the comparison and its folder in the artifact."""
        return f"bpe-{self.vocab_size}"


class LocalCandidate(SpecModel):
    """An existing tokenizer in Hugging Face format (a folder with tokenizer.json) on local disk."""

    kind: Literal["local"]
    name: str = Field(max_length=NAME_MAX, pattern=r"^[a-z0-9][a-z0-9_.-]*$",
                      description="The candidate's name in the comparison and its folder in the artifact.")
    path: str = Field(description="Folder holding tokenizer.json, relative to the spec's folder.")
    path_stamp: FileStamp | None = Field(
        default=None, description="Filled in by compass when it loads the spec (never written by hand): the "
                                  "folder's files, part of the tokenizer step's identity.")

    @property
    def key(self) -> str:
        return self.name


class HubCandidate(SpecModel):
    """A published tokenizer by repository id, read from the local Hugging Face cache (nothing is downloaded:
    `hf download REPO` on a machine with network, then copy the cache)."""

    kind: Literal["hub"]
    repo: str = Field(pattern=r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$",
                      description="Hugging Face repository id (owner/name), e.g. meta-llama/Llama-3.2-1B.")
    revision: str = Field(default="main", description="Branch, tag or commit of the cached snapshot.")
    vocab_size: PositiveInt = Field(description="Its vocabulary size, for planning before it is loaded.")
    repo_stamp: FileStamp | None = Field(
        default=None, description="Filled in by compass when it loads the spec (never written by hand): the "
                                  "commit the revision resolves to in the local cache, and its files.")

    @property
    def key(self) -> str:
        return self.repo.replace("/", "--")


TokenizerCandidate = Annotated[BpeCandidate | LocalCandidate | HubCandidate, Field(discriminator="kind")]


class Selection(SpecModel):
    """How to choose: lowest mean fertility, or the smallest vocabulary within a tolerance of the best."""

    rule: Literal["lowest_fertility", "smallest_within"] = Field(
        default="smallest_within", description="lowest_fertility: the lowest mean tokens per word on held-out text; "
        "smallest_within: the smallest vocabulary whose fertility is within tolerance of the lowest.")
    tolerance: float = Field(default=0.05, ge=0, le=1, description="smallest_within: relative fertility slack.")


class Tokenizer(SpecModel):
    """Candidate tokenizers, each measured on held-out text of every language/domain group, and the rule that picks
    the one the run uses."""

    candidates: list[TokenizerCandidate] = Field(
        min_length=1, description="Tokenizers to compare: BPE trained here, local folders or hub repositories.")
    train_chars: PositiveInt = Field(
        default=20_000_000, description="Characters of curated training text each BPE candidate is trained on."
    )
    eval_chars: PositiveInt = Field(default=2_000_000, description="Held-out characters measured per group.")
    selection: Selection = Field(default=Selection(), description="How the winner is chosen.")
    special_tokens: list[str] = Field(
        default_factory=lambda: ["<|endoftext|>", "<|pad|>"],
        description="Special tokens of each trained BPE candidate: the first is its BOS and EOS, the second its "
                    "padding (the first when only one is given).")
