"""The training loop over the actors' pools: a step top to bottom (job), the pipeline's waits, the prompt stream, checkpoints, held-out evaluation and autoscaling."""
