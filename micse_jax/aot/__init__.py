"""The deviceless compile: THE trainer's program compiled for a GPU or TPU that is not here
(`targets`, `compile`), and reading compiled XLA programs without running them: their kernels by
kind and phase (`hlo`), collectives (`collectives`), what each kernel moves and computes
(`kernel_cost`) and the step time they add up to on a target device (`time_model`). See docs/AOT.md."""
