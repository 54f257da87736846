"""The deviceless compile: THE trainer's program compiled for a GPU or TPU that is not here
(`topology`, `compile`), and reading compiled XLA programs without running them: the HLO text parsed
once (`hlo_module`), its kernels by kind and phase (`hlo`), collectives (`collectives`), what each
kernel moves and computes (`kernel_cost`), the host's work per call (`host`) and the step time they add
up to on a target device (`time_model`, `interconnect`). See docs/AOT.md."""
