"""Evaluation helpers the evaluate and gate kinds use: lighteval run in this process or over ranks, the offline
benchmark data, and the passkey retrieval test."""
