"""Bounds on the numbers a spec holds: a float that becomes a count (tokens) stays a count a plan can print and an
integer can hold (`tokens: 1e308` planned a 309-digit count and `inf` days), and counts of retries and parallel steps
stay ones a machine can carry out."""

MAX_TOKENS = 1e15  # a quadrillion tokens: ~100x SmolLM3's 11T
MAX_RETRIES = 100
MAX_PARALLEL = 1024  # steps or workers at once
