"""Our own accelerator kernels, each beside its reference and its VJP, and the rules that choose them.

`choice.py` says which path each attention layer of a program takes, from what the program is
compiled for (`Target`: platform, compute capability, device count) and the layer's needs;
`dropout_attention.py` is attention with dropout on its probabilities as Pallas (Triton) kernels,
with `reference`, the explicit path's arithmetic they equal. The BERT modules call one attention
op (`models/attention.attend`), which follows the choice.
"""
