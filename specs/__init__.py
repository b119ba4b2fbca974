"""The training spec: pydantic models for why / what / how, YAML loading, checks and the cost planner."""

from compass.specs.loader import SpecError, load_spec, load_spec_text
from compass.specs.spec import TrainingSpec

__all__ = ["SpecError", "TrainingSpec", "load_spec", "load_spec_text"]
