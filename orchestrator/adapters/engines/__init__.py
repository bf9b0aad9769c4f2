"""`RolloutEngine` implementations: transformers in-process, SGLang over HTTP."""
