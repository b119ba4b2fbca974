"""The `compass` command line: the typer app (app.py, the entry point) and one module per group of commands that
needs more than a few lines (operations, monitoring, preflight, why, ablation promotion, the reference page)."""
