"""`RolloutEngine` implementations: transformers in-process (its decoding in `decode`), SGLang over HTTP."""
