"""`models/layer_norm.py` (issue 26's kernel diet): the values and gradients of a LayerNorm, and
which backward each platform lowers.

Forward against the formula in NumPy float64 (two-pass variance, as PyTorch computes it);
gradients against float64 finite differences of that formula and against autodiff of flax's
`nn.LayerNorm`; parameters against `nn.LayerNorm`'s."""
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from micse_jax.models.layer_norm import LayerNorm, layer_norm

EPS = 1e-12


def numpy_layer_norm(x, scale, bias, eps=EPS):
  x = np.asarray(x, np.float64)
  mean = x.mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps) * scale + bias


def _inputs(shape=(3, 5, 16), offset=0.0):
  kx, ks, kb = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(kx, shape) * 2.0 + offset
  return x, 1.0 + 0.3 * jax.random.normal(ks, shape[-1:]), 0.1 * jax.random.normal(kb, shape[-1:])


@pytest.mark.parametrize("offset", [0.0, 30.0])  # 30: a mean far above the spread
def test_forward_equals_the_formula(offset):
  x, scale, bias = _inputs(offset=offset)
  y = layer_norm(x, scale, bias, EPS, jnp.float32)
  assert y.dtype == jnp.float32
  np.testing.assert_allclose(y, numpy_layer_norm(x, scale, bias), rtol=2e-5, atol=2e-5)


def test_half_precision_input_is_normalised_in_float32_and_returned_as_dtype():
  x, scale, bias = _inputs()
  y = layer_norm(x.astype(jnp.bfloat16), scale, bias, EPS, jnp.bfloat16)
  assert y.dtype == jnp.bfloat16
  expected = numpy_layer_norm(np.asarray(x.astype(jnp.bfloat16), np.float64), scale, bias)
  np.testing.assert_allclose(np.asarray(y, np.float64), expected, rtol=1e-2, atol=1e-2)


def _loss(fn, weights):
  return lambda x, scale, bias: jnp.sum(weights * fn(x, scale, bias).astype(jnp.float32))


def test_gradients_equal_finite_differences_of_the_formula():
  x, scale, bias = _inputs(shape=(2, 3, 8))
  weights = jax.random.normal(jax.random.PRNGKey(5), x.shape)
  grads = jax.grad(_loss(lambda *a: layer_norm(*a, EPS, jnp.float32), weights), argnums=(0, 1, 2))(x, scale, bias)
  args, h = [np.asarray(a, np.float64) for a in (x, scale, bias)], 1e-6
  loss = lambda a: float(np.sum(np.asarray(weights, np.float64) * numpy_layer_norm(*a)))
  for i, grad in enumerate(grads):
    expected = np.zeros_like(args[i])
    for index in np.ndindex(args[i].shape):
      up, down = [a.copy() for a in args], [a.copy() for a in args]
      up[i][index] += h
      down[i][index] -= h
      expected[index] = (loss(up) - loss(down)) / (2 * h)
    np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_module_equals_flax_layer_norm_values_and_gradients(dtype):
  x, _, _ = _inputs(shape=(4, 6, 32))
  x = x.astype(dtype)
  ours, theirs = LayerNorm(epsilon=EPS, dtype=dtype), nn.LayerNorm(epsilon=EPS, dtype=dtype)
  params = theirs.init(jax.random.PRNGKey(1), x)
  assert jax.tree.structure(ours.init(jax.random.PRNGKey(1), x)) == jax.tree.structure(params)
  jax.tree.map(np.testing.assert_array_equal, ours.init(jax.random.PRNGKey(1), x), params)
  params = jax.tree.map(lambda p: p + 0.2 * jax.random.normal(jax.random.PRNGKey(2), p.shape), params)
  weights = jax.random.normal(jax.random.PRNGKey(3), x.shape)
  loss = lambda module: lambda p, x: jnp.sum(weights * module.apply(p, x).astype(jnp.float32))
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  np.testing.assert_allclose(np.asarray(ours.apply(params, x), np.float32),
                             np.asarray(theirs.apply(params, x), np.float32), rtol=tol, atol=tol)
  ours_grads = jax.grad(loss(ours), argnums=(0, 1))(params, x)
  theirs_grads = jax.grad(loss(theirs), argnums=(0, 1))(params, x)
  assert ours_grads[1].dtype == dtype
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                                       rtol=tol, atol=tol * 10), ours_grads, theirs_grads)


def _lowered_gradient(platform: str) -> str:
  """The module's gradient as a model compiled for `platform` takes it (its policy's target), lowered for it."""
  from micse_jax.kernels.choice import Target
  from micse_jax.models.policy import Policy
  x, _, _ = _inputs(shape=(4, 8))
  module = LayerNorm(epsilon=EPS)
  params = module.init(jax.random.PRNGKey(1), x)
  with Policy(target=Target(platform)).applied():
    grad = jax.jit(jax.grad(lambda p, x: jnp.sum(module.apply(p, x) ** 2), argnums=(0, 1)))
    return grad.trace(params, x).lower(lowering_platforms=(platform,)).as_text()


def test_cuda_lowering_keeps_the_hand_written_backward_and_cpu_lets_jax_differentiate():
  """CUDA: the backward's sums are two variadic reductions (the row sums of x, x², g and g·x in
  one, so a sharded program cannot split them into two passes; dγ and dβ in the other); CPU: none
  (one reduction per sum)."""
  variadic = lambda text: len(re.findall(r"stablehlo\.reduce\(%\S+ init: %\S+\), \(%\S+ init", text))
  assert variadic(_lowered_gradient("cuda")) == 2
  assert variadic(_lowered_gradient("cpu")) == 0


def test_module_gradients_equal_the_hand_written_vjp_on_cpu():
  x, scale, bias = _inputs(shape=(2, 3, 8))
  weights = jax.random.normal(jax.random.PRNGKey(5), x.shape)
  module = LayerNorm(epsilon=EPS)
  params = {"params": {"scale": scale, "bias": bias}}
  ours = jax.grad(lambda p, x: jnp.sum(weights * module.apply(p, x)), argnums=(0, 1))(params, x)
  own = jax.grad(_loss(lambda *a: layer_norm(*a, EPS, jnp.float32), weights), argnums=(0, 1, 2))(x, scale, bias)
  np.testing.assert_allclose(ours[1], own[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ours[0]["params"]["scale"], own[1], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ours[0]["params"]["bias"], own[2], rtol=1e-5, atol=1e-5)
