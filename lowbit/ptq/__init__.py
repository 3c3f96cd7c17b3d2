"""PTQ algorithms (prepare -> calibrate -> convert), apart from the kernels: CAS, PTS, RPN/CRS,
SmoothAttention, learned NormalFloat scales, GPTQ. They work on ``lowbit.models.arch.LayerView``s."""
