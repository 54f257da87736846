"""Reading compiled XLA programs without running them: what each kernel moves and computes
(`kernel_cost`) and the step time they add up to on a target device (`time_model`)."""
