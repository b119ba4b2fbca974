"""The training spec: pydantic models for why / what / how, YAML loading, checks and the cost planner."""

from specs.loader import SpecError, load_spec, load_spec_text
from specs.spec import TrainingSpec

__all__ = ["SpecError", "TrainingSpec", "load_spec", "load_spec_text"]
