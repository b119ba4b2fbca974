"""Model side: the architecture as transformers classes, packing with intra-document masks, the training
engine (plain torch or DeepSpeed), LR schedules across stages, checkpoints and training monitors."""
