"""The step framework: Step and StepKind (kind.py), what a step gets and gives (context.py), where it runs
(placement.py) and the backends that act on it (backends/: this machine, Ray, Slurm), computing and committing one
(execution.py), the same inside a Slurm job (step_job.py), and the registry of kinds."""
