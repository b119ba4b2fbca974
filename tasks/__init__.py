"""One module per lifecycle phase: each turns a Step and its input artifacts into an output artifact."""
