"""A run never dies on our kernels: when the program holding the dropout-attention kernels fails to
lower or compile (injected here: the kernel raises as Triton would refuse it), `program.compiled`
builds the program again on the explicit path, says so in one warning line naming the kernels and
the reason, and the run trains exactly as one that never tried them."""
import logging

import jax
import pytest

from micse_jax.kernels import choice
from micse_jax.kernels import dropout_attention as da
from micse_jax.training import program, run_inputs, trainer
from micse_jax.workdir import restore_params
from tests.helpers import write_tiny_hf_checkpoint
from tests.train_test import _leaves_equal
from tests.train_utils import tiny_training_config

INTERPRET = choice.Target(interpret=True)


def _config(tmp_path, tokenizer_dir, **overrides):
  """miCSE on a 2-layer random BERT whose heads are 32 wide (a width the kernels take), bfloat16."""
  if not (tmp_path / "tiny_model").exists():
    write_tiny_hf_checkpoint(str(tmp_path / "tiny_model"), tokenizer_dir, mlm=False, hidden_size=64,
                             num_attention_heads=2, intermediate_size=128)
  return tiny_training_config(tmp_path, tokenizer_dir, **{"model.dtype": "bfloat16", "ami.layers": (0,), **overrides})


def _refusing(*args, **kwargs):
  raise RuntimeError("Triton support is only enabled for Ampere GPUs (injected)")


def _program(config, target):
  run = run_inputs.prepare(config)
  run.encoder_params = jax.device_get(run.encoder_params)  # host arrays: each placed state has fresh buffers
  return program.build(config, run.bert_config, program.abstract_of(run.encoder_params), jax.devices()[:1],
                       run.tokens, target), run


def test_a_failing_kernel_is_replaced_by_the_explicit_path_with_one_warning(tmp_path, tiny_real_dir, monkeypatch,
                                                                            caplog):
  config = _config(tmp_path, tiny_real_dir)
  prog, run = _program(config, INTERPRET)
  assert prog.target.pallas  # its encoders take the kernels (tests/dropout_attention_test.py: the model's jaxpr)
  monkeypatch.setattr(da, "_pallas", _refusing)
  with caplog.at_level(logging.WARNING):
    fell_back = program.compiled(prog)
  warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
  assert len(warnings) == 1 and "\n" not in warnings[0]
  assert "dropout-attention kernels" in warnings[0] and "only enabled for Ampere GPUs (injected)" in warnings[0]
  assert fell_back.target.own_kernels is False and not fell_back.target.pallas
  assert "pallas_call" not in str(jax.make_jaxpr(fell_back.jitted)(prog.abstract_state, prog.abstract_batch()))

  plain = program.compiled(_program(config, choice.Target())[0])  # never tried the kernels
  state = lambda p: p.initial_state([run])
  batch = prog.place_batch([run.batches.batch(0)])
  got = fell_back.run(state(fell_back), batch)[0]
  want = plain.run(state(plain), prog.place_batch([run.batches.batch(0)]))[0]
  _leaves_equal(got, want)


@pytest.mark.parametrize("target, overrides", [
    (choice.Target(), {}),                                                       # no kernels on this CPU
    (INTERPRET, {"model.attention": "explicit"}),                                # the kernels turned off
    (choice.Target(platform="cuda", compute_capability=(9, 0)), {"model.remat": "layer"})])  # remat: explicit on GPUs
def test_a_program_without_our_kernels_keeps_its_own_error(tmp_path, tiny_real_dir, monkeypatch, caplog, target,
                                                            overrides):
  prog, _ = _program(_config(tmp_path, tiny_real_dir, **overrides), target)
  monkeypatch.setattr(program.Program, "lower", lambda self: _refusing())
  with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError, match="injected"):
    program.compiled(prog)
  assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_the_trainer_trains_on_when_the_kernels_fail(tmp_path, tiny_real_dir, monkeypatch, caplog):
  """Through `train_and_evaluate`: the devices' target is made to take the kernels (the interpreter)
  and the kernels to fail; the run finishes, its params those of a run on the explicit path."""
  config = _config(tmp_path, tiny_real_dir, num_train_steps=2, checkpoint_every=2)
  trainer.train_and_evaluate(config, str(tmp_path / "plain"))
  target_of = choice.target_of
  monkeypatch.setattr(choice, "target_of", lambda devices, mesh=None: target_of(devices, interpret=True, mesh=mesh))
  monkeypatch.setattr(da, "_pallas", _refusing)
  with caplog.at_level(logging.WARNING):
    trainer.train_and_evaluate(config, str(tmp_path / "fell_back"))
  assert sum("dropout-attention kernels" in r.getMessage() for r in caplog.records) == 1
  (_, got), (_, want) = (restore_params(str(tmp_path / w)) for w in ("fell_back", "plain"))
  _leaves_equal(got, want)
