"""Compass's trainer and what it is made of: the job it reads, engines (DeepSpeed, DDP, FSDP2), collectives,
checkpoints, packing and token files, schedules, staging, callbacks, monitors, telemetry and the hang watchdog."""
