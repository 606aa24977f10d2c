"""Training front end: configuration, data pipeline, trainer, checkpoints, fine-tuning a Hugging Face
checkpoint (`finetune.py`), exporting a run to one (`export.py`) and the `taco` CLI."""
