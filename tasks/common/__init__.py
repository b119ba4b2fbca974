"""What several kinds share: building and running a training job (tasks/common/training.py), devices and
precision for a library's model, plots, experiment-tracker runs."""
