"""`python -m micse_jax.bench`: where the training step's time goes, against PyTorch.

Modules: `jax_step` (the full jitted step and its time by phase), `torch_step` (the PyTorch
peers of the same objective), `timing` (pipelined and blocked step times, alike for both),
`encode` (SentenceEncoder.encode against sentence-transformers), `hardware` (peak FLOP/s for
MFU, peak memory), `flops` (the step's model FLOPs, MFU's numerator), `rows` (results saved as
measured), `__main__` (the CLI). The GPU kit that runs these on a lent GPU is not part of the
installed package: `benchmarks/` and `scripts/device/` in the checkout (docs/GPU_ACCEPTANCE.md).
"""
