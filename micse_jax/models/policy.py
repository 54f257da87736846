"""How a `BertModel` computes, never what: one field (`BertModel.policy`) read by every layer.

`attention` is `model.attention`: "fused" lets each attention layer take the fastest path that
computes its values on the program's target (`kernels/choice.py`), "explicit" keeps every layer
on the explicit softmax (the A/B of the kernels). `remat` is `model.remat` (`models/remat.py`).
`target` is what the program is compiled for (`kernels/choice.Target`: the trainer's program
takes it from its devices); None means this process's default device. `split_tables`: the train
state holds the embedding tables split by features over the target's mesh (FSDP,
`training/state_placement.leaf_partition`), so the lookups take them as they are (`models/embed.py`). No
choice changes the parameter tree or the function computed.

The modules that hold a policy (`BertModel`, `BertLayer`, InfoCSE's auxiliary network) apply their
layers under it (`Policy.applied`), as flax's logical axis rules are set around a model: the
drop-in layers (`Dense`, `LayerNorm`, `Embed`), which keep flax's constructor signatures, read
where their rows and tables lie and whether to take the hand-written CUDA gradients from the
policy in effect (`current`), never from constructor arguments.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading

from micse_jax.kernels import choice
from micse_jax.models.column_sums import RowSums
from micse_jax.models.remat import REMAT_POLICIES

ATTENTION_MODES = ("explicit", "fused")  # `model.attention`'s choices (config_checks reads this)


@dataclasses.dataclass(frozen=True)
class Policy:
  """The attention mode, the rematerialisation and the compile target of a model (module docstring)."""
  attention: str = "fused"
  remat: str = "none"
  target: choice.Target | None = None
  split_tables: bool = False

  def __post_init__(self):
    if self.attention not in ATTENTION_MODES:
      raise ValueError(f"unsupported attention {self.attention!r}; expected one of {ATTENTION_MODES}")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"unsupported remat {self.remat!r}; expected one of {sorted(REMAT_POLICIES)}")

  def attention_path(self, **layer) -> str:
    """`kernels/choice.attention_path` of one layer (its keywords but `explicit`) under this policy."""
    return choice.attention_path(self.target, explicit=self.attention == "explicit", remat=self.remat, **layer)

  @property
  def interpret(self) -> bool:
    """Whether the Pallas kernels run in the interpreter (tests)."""
    return bool(self.target and self.target.interpret)

  @property
  def mesh(self):
    """The mesh a step's rows are split over (the kernels run per device under it), or None."""
    return self.target.mesh if self.target else None

  @property
  def table_mesh(self):
    """The mesh the embedding tables arrive split over (`split_tables`), or None: whole tables."""
    return self.mesh if self.split_tables else None

  @property
  def row_split(self) -> int:
    """How many devices the rows are split over (1 without a mesh): each device sums its own rows'
    bias and LayerNorm gradients (`models/column_sums.py`)."""
    return self.mesh.size if self.mesh is not None else 1

  @property
  def own_gradients(self) -> bool:
    """Whether the layers take the hand-written CUDA gradients (`kernels/choice.own_gradients`)."""
    return choice.own_gradients(self.target)

  @property
  def row_sums(self) -> RowSums:
    """How the layers' gradients are summed over rows (`models/column_sums.py`): in two stages fitted to
    each device's rows where the CUDA gradients are taken, one plain reduction elsewhere."""
    return RowSums(two_stage=self.own_gradients, devices=self.row_split)

  @contextlib.contextmanager
  def applied(self):
    """This policy in effect (`current`) for the layers applied inside the block."""
    _in_effect.stack.append(self)
    try:
      yield self
    finally:
      _in_effect.stack.pop()


class _InEffect(threading.local):
  stack: list  # the policies applied, innermost last (per thread: tracing runs on the caller's)

  def __init__(self):
    self.stack = []


_in_effect = _InEffect()


def current() -> Policy:
  """The policy of the innermost model being applied (`Policy.applied`); `Policy()` outside any."""
  return _in_effect.stack[-1] if _in_effect.stack else Policy()
