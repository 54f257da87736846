"""`python -m micse_jax.bench`: where the training step's time goes, against PyTorch.

Modules: `jax_step` (the full jitted step and its separately jitted pieces), `torch_step`
(the PyTorch baseline of the same objective), `encode` (SentenceEncoder.encode against
sentence-transformers), `hardware` (peak FLOP/s for MFU, peak memory), `flops` (the step's model FLOPs, MFU's numerator), `__main__` (the CLI).
"""
