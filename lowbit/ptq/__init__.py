"""PTQ algorithms (prepare -> calibrate -> convert), apart from the kernels: CAS, PTS, RPN/CRS,
SmoothAttention, learned NormalFloat scales. They work on ``lowbit.models.arch.LayerView``s."""
