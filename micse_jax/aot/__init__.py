"""The deviceless compile: THE trainer's program compiled for a GPU or TPU that is not here, and
what its compiled program says (kernels by kind and phase, collectives, memory). See docs/AOT.md."""
