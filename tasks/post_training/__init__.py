"""Post-training helpers the post_train kind uses: TRL jobs and their ranks, datasets and their accepted shapes,
preference pairs, chat templates, LoRA adapters, TRL checkpoints and trackers."""
