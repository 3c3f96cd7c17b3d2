"""Evaluation: the embedded corpus, perplexity, attention-error studies."""
