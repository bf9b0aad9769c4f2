"""`WeightTransport`: pushing the trainer's tensors to an engine in buckets."""
