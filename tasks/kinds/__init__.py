"""The step kinds: one module per kind (ingest, curate, tokenizer, tokenize, ablate, pretrain, long_context,
mid_training, post_train, evaluate, gate, curves, report, base and named models), each defining its config, builder,
executor and `STEP_KINDS`; tasks/steps/registry.py lists them. Nothing below imports a kind."""
