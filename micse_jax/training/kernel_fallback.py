"""When our kernels fail, the program is built again without them (`program.compiled`): what tells
their failure from any other (`our_kernels_failed`), and the one run that finds a kernel that cannot
be launched before the run's state exists (`run_once`)."""
from __future__ import annotations

import os
import traceback

import jax
import jax.numpy as jnp

from micse_jax.kernels import choice, dropout_attention

# What names our kernels or hand-written CUDA gradients in a lowered program's text and in an error's message
KERNEL_MARKS = choice.OWN_MARKS


def may_take_kernels(prog) -> bool:
  """Whether any layer of the program may take the kernels (`choice.kernels_allowed`) or the hand-written
  CUDA gradients (`choice.own_gradients`) on its target: the cheap test before its text is read."""
  model = prog.config.model
  return (choice.kernels_allowed(prog.target, explicit=model.attention == "explicit", remat=model.remat)
          or choice.own_gradients(prog.target))


def holds_our_kernels(lowered) -> bool:
  """Whether the lowered program calls the dropout-attention kernels or holds the CUDA gradients (their
  names or scope are in its text: a Triton call's backend config, the interpreter's name stack)."""
  text = lowered.as_text(debug_info=True)
  return any(mark in text for mark in KERNEL_MARKS)


def _error_chain(error: BaseException) -> list[BaseException]:
  """`error` and the exceptions it was raised from or during (JAX adds the traceback of the traced op)."""
  chain = []
  while error is not None and all(error is not e for e in chain):
    chain.append(error)
    error = error.__cause__ or error.__context__
  return chain


def our_kernels_failed(lowered, error: BaseException) -> bool:
  """Whether `error` is our kernels' failure: raised inside their module while the program was traced or
  lowered (a frame of `kernels/dropout_attention.py` in a traceback of its chain), or raised by XLA's
  compile or the run of a program that holds them, naming them (`KERNEL_MARKS` in a message)."""
  chain = _error_chain(error)
  module = os.path.abspath(dropout_attention.__file__)
  if any(os.path.abspath(frame.filename) == module for e in chain for frame in traceback.extract_tb(e.__traceback__)):
    return True
  named = any(mark in str(e) for e in chain for mark in KERNEL_MARKS)
  return named and lowered is not None and holds_our_kernels(lowered)


def worth_running_once(prog, lowered) -> bool:
  """Whether `program.compiled(run_once=True)` runs the compiled step once: its layers may take our
  kernels, this process alone runs it, and it holds them (the cheap tests first)."""
  return may_take_kernels(prog) and runs_here(prog) and holds_our_kernels(lowered)


def runs_here(prog) -> bool:
  """Whether this process alone runs the program: its devices are this process's (not a deviceless target's)."""
  return jax.process_count() == 1 and set(prog.mesh.devices.flat) <= set(jax.local_devices())


def run_once(prog, executable) -> None:
  """The compiled step called once on a zero state and batch, placed as it takes them, and waited for:
  a kernel that cannot be launched raises here (XLA names the kernel it failed to launch)."""
  abstract = (prog.abstract_state, prog.abstract_batch())
  zeros = jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype, device=leaf.sharding), abstract)
  jax.block_until_ready(executable(*prog.inputs(*zeros)))
