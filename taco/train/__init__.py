"""Training front end: configuration, data pipeline, trainer, checkpoints and the `taco` CLI."""
