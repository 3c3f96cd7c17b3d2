"""Model integration (transformers): loading, architecture views, recipes, checkpoints, generation.

Imports transformers lazily; nothing here is imported by ``import lowbit``."""
