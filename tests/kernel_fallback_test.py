"""A run never dies on our kernels: when the program holding the dropout-attention kernels fails to
lower or compile (injected here: the kernel raises as Triton would refuse it, or XLA's compile names
it) or, with `run_once`, to launch, `program.compiled` builds the program again on the explicit
path, says so in one warning line naming the kernels and the reason, and the run trains exactly as
one that never tried them. Any other failure (a program without kernel calls, an error that does not
name them) is raised as it is, once."""
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
  assert "pallas_call" not in str(jax.make_jaxpr(fell_back.jitted)(*prog.abstract_inputs()))

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


class _FailingCompile:
  """A lowered program whose compile fails with `message` (as XLA would), counted in `attempts`."""

  def __init__(self, lowered, message: str, attempts: list):
    self.lowered, self.message, self.attempts = lowered, message, attempts

  def as_text(self, *args, **kwargs):
    return self.lowered.as_text(*args, **kwargs)

  def compile(self, *args, **kwargs):
    self.attempts.append(self.message)
    raise jax.errors.JaxRuntimeError(self.message)


def _failing_compiles(monkeypatch, message: str) -> list:
  """Every `Program.lower()` returns a program whose compile fails with `message`; returns the attempts."""
  attempts, lower = [], program.Program.lower
  monkeypatch.setattr(program.Program, "lower", lambda self: _FailingCompile(lower(self), message, attempts))
  return attempts


TILE_ERROR = ("INTERNAL: Couldn't find output tile sizes that satisfy hlo: %dot.118 = f32[16000,64]{1,0} "
              "dot(%bitcast.439, %parameter_1.41), metadata={op_name=\"jit(train_step)/transpose(jvp(encode))/BertModel/"
              "encoder/layer_0/attention/self/dot_general\"}")


def _holds_kernel_calls(prog) -> bool:
  return "pallas_call" in str(jax.make_jaxpr(prog.jitted)(*prog.abstract_inputs()))


def test_a_program_without_kernel_calls_keeps_its_compile_error_once(tmp_path, tiny_real_dir, monkeypatch, caplog):
  """float32 on a target where the kernels may run: no layer takes them (they compute in half precision),
  so XLA's own compile failure is the error, raised once: no warning about kernels, no second compile."""
  prog, _ = _program(_config(tmp_path, tiny_real_dir, **{"model.dtype": "float32"}), INTERPRET)
  assert prog.target.pallas and not _holds_kernel_calls(prog)
  attempts = _failing_compiles(monkeypatch, TILE_ERROR)
  with caplog.at_level(logging.WARNING), pytest.raises(jax.errors.JaxRuntimeError, match="output tile sizes"):
    program.compiled(prog)
  assert attempts == [TILE_ERROR]
  assert not [r for r in caplog.records if "dropout-attention kernels" in r.getMessage()]


@pytest.mark.parametrize("message, ours", [
    (TILE_ERROR, False),  # XLA's own GEMM tiling: nothing of ours in it
    ("INTERNAL: Triton compilation failed for custom-call micse_dropout_attention_backward_h2 (injected)", True),
    ('INTERNAL: ptxas failed for custom_call_target="__gpu$xla.gpu.triton" (injected)', True)])
def test_a_compile_error_falls_back_only_when_it_names_our_kernels(tmp_path, tiny_real_dir, monkeypatch, caplog,
                                                                   message, ours):
  prog, _ = _program(_config(tmp_path, tiny_real_dir), INTERPRET)
  assert _holds_kernel_calls(prog)
  attempts = _failing_compiles(monkeypatch, message)
  with caplog.at_level(logging.WARNING):
    if ours:
      with pytest.raises(jax.errors.JaxRuntimeError, match="injected"):  # the plain program's compile fails too here
        program.compiled(prog)
    else:
      with pytest.raises(jax.errors.JaxRuntimeError, match="output tile sizes"):
        program.compiled(prog)
  warned = [r.getMessage() for r in caplog.records if "dropout-attention kernels" in r.getMessage()]
  assert len(attempts) == (2 if ours else 1) and len(warned) == (1 if ours else 0)
  assert not ours or "failed to compile" in warned[0]


def test_a_compile_error_naming_the_cuda_gradients_falls_back_without_them(tmp_path, tiny_real_dir, monkeypatch,
                                                                          caplog):
  """A V100 target takes no Pallas kernels (the explicit path) but the hand-written CUDA gradients
  (`choice.own_gradients`); an XLA compile error naming one of their ops (their scope in its op_name,
  as XLA quotes an instruction's metadata) builds the program again without them, after one warning."""
  prog, _ = _program(_config(tmp_path, tiny_real_dir), choice.Target("cuda", (7, 0)))
  message = ("INTERNAL: Couldn't find output tile sizes that satisfy hlo: %reduce.7 = f32[50,64,64]{2,1,0} "
             f"reduce(...), metadata={{op_name=\"jit(train_step)/transpose(jvp(encode))/BertModel/encoder/layer_0/"
             f"output/LayerNorm/{choice.OWN_GRADIENT_SCOPE}/reduce\"}} (injected)")
  built, attempts, lower = [], [], program.Program.lower

  def lower_failing(self):
    lowered = lower(self)
    built.append((self.target.own_kernels, choice.OWN_GRADIENT_SCOPE in lowered.as_text(debug_info=True)))
    return _FailingCompile(lowered, message, attempts)
  monkeypatch.setattr(program.Program, "lower", lower_failing)
  with caplog.at_level(logging.WARNING), pytest.raises(jax.errors.JaxRuntimeError, match="injected"):
    program.compiled(prog)  # the plain program's compile fails too here
  assert built == [(True, True), (False, False)]  # the CUDA gradients first, then none of them
  warned = [r.getMessage() for r in caplog.records if "CUDA gradients" in r.getMessage()]
  assert len(warned) == 1 and "failed to compile for cuda sm 7.0" in warned[0]


def _failing_when_run(message: str):
  """`_pallas` that runs as before, plus a host callback raising `message` when the program runs."""
  real = da._pallas

  def fail(*_):
    raise RuntimeError(message)

  def pallas(projection, *args, **kwargs):
    jax.debug.callback(fail, projection[0, 0, 0])
    return real(projection, *args, **kwargs)
  return pallas


@pytest.mark.slow  # the interpreted kernels' program compiled and run: ~35 s each on an idle 2-core CPU
@pytest.mark.parametrize("message, ours", [
    ("Failed to launch CUDA kernel: micse_dropout_attention_h2 with block dimensions: 128x1x1: "
     "CUDA_ERROR_OUT_OF_RESOURCES (injected)", True),
    ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 80.00GiB (injected)", False)])
def test_a_kernel_that_fails_when_run_falls_back_before_training(tmp_path, tiny_real_dir, monkeypatch, caplog,
                                                                 message, ours):
  """`run_once` (the trainer's): the compiled step runs once on zeros; a launch failure that names our
  kernel is their failure (the explicit program follows, its step runs), any other is raised."""
  prog, run = _program(_config(tmp_path, tiny_real_dir), INTERPRET)
  monkeypatch.setattr(da, "_pallas", _failing_when_run(message))
  with caplog.at_level(logging.WARNING):
    if not ours:
      with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
        program.compiled(prog, run_once=True)
      assert not [r for r in caplog.records if "dropout-attention kernels" in r.getMessage()]
      return
    fell_back = program.compiled(prog, run_once=True)
  warned = [r.getMessage() for r in caplog.records if "dropout-attention kernels" in r.getMessage()]
  assert len(warned) == 1 and "failed when run" in warned[0]
  assert not fell_back.target.own_kernels and not _holds_kernel_calls(fell_back)
  state, batch = fell_back.initial_state([run]), fell_back.place_batch([run.batches.batch(0)])
  jax.block_until_ready(fell_back.step(*fell_back.inputs(state, batch)))


@pytest.mark.slow  # ~25 s: the program-level fallback tests stay in the default run
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
