"""Which of our kernels and hand-written gradients a model takes, from what its program is compiled
for (its `Target`): the rules in one place, and one switch (`Target.own_kernels`) that turns them all off.

An attention layer's path is one of
  "explicit"        softmax(QKᵀ/√d + mask) as XLA ops, the probabilities materialised: under
                    `model.attention=explicit`, where the kernels cannot run, and for a layer
                    without dropout whose probabilities are read (AMI's sown layers in eval);
  "dropout_kernel"  `kernels/dropout_attention.py`'s Pallas kernels, for a layer that trains with
                    dropout on its probabilities; a sown layer's kernels also write its float32
                    dropped probabilities and take the gradient AMI sends them;
  "cudnn"           cuDNN's flash attention (`jax.nn.dot_product_attention(implementation="cudnn")`)
                    for a layer without dropout whose probabilities nothing reads;
  "xla"             XLA's own `jax.nn.dot_product_attention` for such a layer elsewhere.
Every path computes the explicit path's values (the kernels: the same roundings and dropout bits;
cuDNN and XLA's attention: the same function, without dropout).

The kernels run only where they can and were tested: Pallas' Triton backend needs a CUDA GPU of
compute capability 8.0 or more (XLA refuses Triton for Volta; the capability is read from the
target's devices, so a deviceless `--aot v100` compile chooses as a real V100 would), the shapes
and dtypes the kernels' tests cover (`KERNEL_LENGTHS`, `KERNEL_HEAD_DIMS`, `KERNEL_DTYPES`),
flax's dropout draw (32-bit threefry words, the bits the kernel reproduces) and layers that are not
rematerialised (`KERNEL_REMAT`), on any number of devices: a Pallas call is a custom call XLA's
SPMD partitioner does not split by rows, so on a data-parallel program (`Target.mesh`) the kernels
run under `shard_map` on each device's rows (`dropout_attention.dropout_attention`). cuDNN's flash
attention also needs compute capability 8.0 and a shape cuDNN takes (`cudnn_takes`). The
interpreter (`Target.interpret`) runs the kernels on any device for tests.

The model's hand-written CUDA gradients (`own_gradients`) are chosen from the same target: the
LayerNorm VJP (`models/layer_norm.py`), the two-stage sums over rows of the bias and LayerNorm
gradients (`models/column_sums.py`) and the small tables' summed lookup gradient
(`models/embed.py`) run where the target is a CUDA GPU (a deviceless `--aot h100` compile on this
CPU included: the target, not the machine that lowers, decides); elsewhere JAX differentiates the
same forward (XLA:CPU runs their variadic reductions as scalar loops). Their backward ops are named
`OWN_GRADIENT_SCOPE`, so a compile error of theirs names them (`OWN_MARKS`), and a program built
again without our kernels (`Target.own_kernels` False: `training/program.compiled`'s fallback)
takes neither the kernels nor these gradients: one fallback covers them all.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from micse_jax.kernels.dropout_attention import KERNEL_NAME

PATHS = ("explicit", "dropout_kernel", "cudnn", "xla")
KERNEL_LENGTHS = (16, 32, 64, 128)    # sequence lengths the dropout-attention kernels are tested at
KERNEL_HEAD_DIMS = (32, 64, 128)      # head dims likewise (Triton's dot needs >= 16)
KERNEL_DTYPES = ("bfloat16", "float16")  # Triton's GEMMs take half precision
# `model.remat` policies the kernels passed their GPU test under: rematerialised layers (`layer`,
# `full`) failed it on an H200 (jax 0.11.2) while the interpreter agrees with the explicit path, so
# they keep the explicit path on a GPU until a lent GPU shows why (the interpreter still runs them)
KERNEL_REMAT = ("none",)
MIN_COMPUTE_CAPABILITY = (8, 0)       # Pallas-Triton and cuDNN flash attention: Ampere and newer
MAX_CUDNN_HEAD_DIM = 128
# The name scope of the hand-written CUDA gradients' backward ops (`own_gradients`): in the op names
# of a lowered program and of XLA's errors about them
OWN_GRADIENT_SCOPE = "micse_cuda_gradient"
# What names our kernels or gradients in a lowered program's text and in an error's message: the
# dropout-attention kernels' names (the backward kernel's begins with the forward's), Pallas' Triton
# custom calls (no other Pallas call is in the program), the hand-written gradients' scope
OWN_MARKS = (KERNEL_NAME, "__gpu$xla.gpu.triton", "triton_kernel_call", OWN_GRADIENT_SCOPE)


@dataclasses.dataclass(frozen=True)
class Target:
  """What a program is compiled for, as far as the choice of kernels and gradients goes.

  platform: "cuda", "rocm", "tpu" or "cpu"; compute_capability: CUDA's (major, minor), None
  elsewhere; devices: how many devices the program spans; mesh: the 1-D mesh a step's rows are
  split over (None where each device runs a program of its own rows: one device, or a
  population's members spread one per device); interpret: run the Pallas kernels in
  Pallas' interpreter (any platform: the kernels' tests on CPU); own_kernels: False keeps our
  Pallas kernels and hand-written CUDA gradients out whatever the device (the program built again
  after they failed to compile, `training/program.compiled`); trial: also where they are not proven yet (`KERNEL_REMAT`): the GPU
  tests that would prove them.
  """
  platform: str = "cpu"
  compute_capability: tuple[int, int] | None = None
  devices: int = 1
  mesh: Mesh | None = None
  interpret: bool = False
  own_kernels: bool = True
  trial: bool = False

  @property
  def ampere_or_newer(self) -> bool:
    """A CUDA GPU of compute capability >= 8.0: where Triton and cuDNN's flash attention run."""
    return self.platform == "cuda" and (self.compute_capability or (0, 0)) >= MIN_COMPUTE_CAPABILITY

  @property
  def pallas(self) -> bool:
    """Whether the Pallas kernels may run: the interpreter, or Triton on Ampere-or-newer GPUs."""
    return self.own_kernels and (self.interpret or self.ampere_or_newer)

  def describe(self) -> str:
    """The target in a few words, for messages: "cuda sm 9.0", "cpu", "cuda sm 7.0 x8"."""
    cc = ".".join(map(str, self.compute_capability)) if self.compute_capability else None
    return self.platform + (f" sm {cc}" if cc else "") + (f" x{self.devices}" if self.devices > 1 else "")


def _capability(device) -> tuple[int, int] | None:
  text = getattr(device, "compute_capability", None)
  if not text:
    return None
  major, _, minor = str(text).partition(".")
  return int(major), int(minor or 0)


def _platform(device) -> str:
  """"cuda" for an NVIDIA GPU (real or a deviceless target's: both carry a compute capability)."""
  platform = device.platform.lower()
  if platform in ("gpu", "cuda"):
    return "cuda" if _capability(device) else "rocm"
  return platform


def target_of(devices, interpret: bool = False, mesh: Mesh | None = None) -> Target:
  """The `Target` of a program placed on `devices` (this machine's, or a deviceless target's), its
  rows split over `mesh` (None: each device runs its own rows)."""
  devices = list(devices)
  first = devices[0]
  mesh = mesh if mesh is not None and mesh.size > 1 else None
  return Target(_platform(first), _capability(first), len(devices), mesh, interpret)


@functools.lru_cache(maxsize=None)
def local_target() -> Target:
  """This process's default device, one of it: what a model built without a target runs on."""
  return target_of(jax.devices()[:1])


def own_gradients(target: Target | None) -> bool:
  """Whether a model compiled for `target` (None: this process's device) takes the hand-written CUDA
  gradients (module docstring): a CUDA target, our kernels not turned off."""
  target = target or local_target()
  return target.own_kernels and target.platform == "cuda"


def kernel_takes(length: int, head_dim: int, dtype, random_bits: int, rng_impl: str) -> bool:
  """Whether the dropout-attention kernels compute a layer of these shapes and dropout draw."""
  return (length in KERNEL_LENGTHS and head_dim in KERNEL_HEAD_DIMS and jnp.dtype(dtype).name in KERNEL_DTYPES
          and random_bits == 32 and rng_impl == "threefry")


def _cudnn_attention(q, k, v, mask):
  return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="cudnn")


@functools.lru_cache(maxsize=None)
def cudnn_takes(q_shape: tuple, k_shape: tuple, mask_shape: tuple, dtype: str) -> bool:
  """Whether cuDNN attention is installed here and accepts these `[B, T, heads, d]` shapes, the
  mask broadcast to `[B, 1, T, S]`."""
  head_dim = q_shape[-1]
  if dtype not in KERNEL_DTYPES or head_dim % 8 or head_dim > MAX_CUDNN_HEAD_DIM:
    return False
  spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt)
  try:  # tracing checks the installed cuDNN and its shape rules; nothing runs
    jax.eval_shape(_cudnn_attention, spec(q_shape, dtype), spec(k_shape, dtype), spec(k_shape, dtype),
                   spec(mask_shape, jnp.bool_))
  except (RuntimeError, NotImplementedError, ValueError, TypeError):
    return False
  return True


def kernels_allowed(target: Target, *, explicit: bool, remat: str) -> bool:
  """Whether a model under `model.attention` (`explicit` or not) and `model.remat` may hold the
  dropout-attention kernels on `target`; each layer that trains with dropout then takes them where
  `kernel_takes` its shape."""
  return target.pallas and not explicit and (target.interpret or target.trial or remat in KERNEL_REMAT)


def attention_path(target: Target | None, *, explicit: bool, reads_probabilities: bool, dropout: bool,
                   q_shape: tuple, k_shape: tuple, dtype, random_bits: int = 32, rng_impl: str = "threefry",
                   remat: str = "none") -> str:
  """The path (`PATHS`) of one attention layer with `[B, T, heads, d]` queries and keys.

  explicit: `model.attention=explicit`; reads_probabilities: the layer's probabilities are sown
  (AMI: the kernels return them too, cuDNN's and XLA's attention do not); dropout: the layer drops
  probabilities in this call (train mode, rate > 0); remat: the layer's `model.remat` policy."""
  target = target or local_target()
  if explicit:
    return "explicit"
  if dropout:
    takes = kernel_takes(k_shape[1], k_shape[-1], dtype, random_bits, rng_impl)
    return "dropout_kernel" if kernels_allowed(target, explicit=False, remat=remat) and takes else "explicit"
  if reads_probabilities:
    return "explicit"
  mask_shape = (q_shape[0], 1, q_shape[1], k_shape[1])
  if target.ampere_or_newer and cudnn_takes(tuple(q_shape), tuple(k_shape), mask_shape, jnp.dtype(dtype).name):
    return "cudnn"
  return "xla"
