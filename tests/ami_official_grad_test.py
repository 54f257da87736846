"""The *gradient* of the official-code AMI term (`official_ami_loss`) with respect to
both views' attention maps, against torch autograd on an independent transcription of the term in
SAP-samples/acl2023-micse (`model/models.py`, `cl_forward`), on a fixed sample of cells.

The transcription takes the two views' attention `[L, B, H, T, T]`, lays them out as the public
code does (views interleaved in the batch, then rows "(h k m) i (j t z)": one row per sentence,
head and layer parity), keeps the rows with at least m cells > 0 in both views, and on the given
cells computes loss = -λ · ((valid fraction of the kept rows)² + 1e-6) · mean_rows(-½ log(1 - cos²)),
cos being the cosine of the centred log-values (the scale carries no gradient: it comes from a
comparison mask). Only the choice of cells is taken from outside: by construction in the first
test (every kept row has exactly m valid cells, so the sample is all of them) and from the public
`official_attention_mutual_information` result in the second.
"""
import jax
import numpy as np
import pytest

from micse_jax.losses import ami_official

torch = pytest.importorskip("torch")

LAMBDA = 2.5e-3


def _views(rng, num_layers, batch, heads, length, lengths=None):
  """Two correlated views of softmax attention; padding keys (beyond `lengths`) exactly 0."""
  lengths = [length] * batch if lengths is None else lengths
  mask = (np.arange(length)[None] < np.asarray(lengths)[:, None]).astype(np.int32)
  scores = rng.normal(size=(num_layers, batch, heads, length, length))
  views = []
  for _ in range(2):
    noisy = np.where(mask[None, :, None, None, :] > 0, scores + 0.6 * rng.normal(size=scores.shape), -np.inf)
    att = np.exp(noisy - noisy.max(-1, keepdims=True))
    views.append((att / att.sum(-1, keepdims=True)).astype(np.float32))
  return views[0], views[1], mask


def _official_rows(a1, a2):
  """torch: `[L, B, H, T, T]` × 2 → (X, Y) `[B·H·2, (L/2)·T·T]`, row (b, head k, parity m) = b·2H + 2k + m."""
  num_layers, batch, heads, t, _ = a1.shape
  both = torch.stack([a1.permute(1, 0, 2, 3, 4), a2.permute(1, 0, 2, 3, 4)], dim=1)  # (h i) (j m) k t z
  rows = both.reshape(batch, 2, num_layers // 2, 2, heads, t, t).permute(0, 4, 3, 1, 2, 5, 6)  # h k m i j t z
  rows = rows.reshape(batch * heads * 2, 2, (num_layers // 2) * t * t)
  return rows[:, 0], rows[:, 1]


def _torch_official(att1, att2, cells_of_row, weight=LAMBDA):
  """(loss, d loss/d att1, d loss/d att2) of the official term on the given kept rows and cells."""
  a1 = torch.tensor(att1, dtype=torch.float64, requires_grad=True)
  a2 = torch.tensor(att2, dtype=torch.float64, requires_grad=True)
  x, y = _official_rows(a1, a2)
  valid = torch.logical_and(x > 0, y > 0).double()
  kept = sorted(cells_of_row)
  scale = (valid[kept].sum() / valid[kept].numel()) ** 2 + 1e-6
  mis = []
  for r in kept:
    cells = torch.as_tensor(sorted(cells_of_row[r]))
    u, v = torch.log(x[r, cells]), torch.log(y[r, cells])
    du, dv = u - u.mean(), v - v.mean()
    cos = (du * dv).sum() / torch.clamp(du.norm() * dv.norm(), min=1e-6)
    mis.append(-0.5 * torch.log(1.0 - cos ** 2))
  loss = -torch.stack(mis).mean() * scale * weight
  loss.backward()
  return float(loss.detach()), a1.grad.numpy(), a2.grad.numpy()


def _jax_official(att1, att2, mask, key, num_samples):
  del mask  # the official variant needs none: padding keys are exact zeros
  fn = lambda a1, a2: ami_official.official_ami_loss(a1, a2, key, weight=LAMBDA, num_samples=num_samples)[0]
  loss, grads = jax.value_and_grad(fn, argnums=(0, 1))(att1, att2)
  return float(loss), np.asarray(grads[0]), np.asarray(grads[1])


def _assert_grads_match(ours, want):
  for g, w in zip(ours, want):
    scale = np.abs(w).max()
    assert scale > 0
    np.testing.assert_allclose(g, w, rtol=2e-3, atol=2e-4 * scale)
    np.testing.assert_array_equal(g == 0, w == 0)  # same cells carry (no) gradient


@pytest.mark.slow  # ~20 s: its random-sample twin stays in the default run
def test_gradient_matches_torch_when_the_sample_is_every_valid_cell():
  """Each kept row has exactly m valid cells (so the sample is all of them); the others fewer."""
  rng = np.random.default_rng(0)
  num_layers, batch, heads, t = 4, 2, 2, 5
  att1, att2, mask = _views(rng, num_layers, batch, heads, t)
  cells = (num_layers // 2) * t * t  # 50 per row
  zeros = {}  # row -> number of cells zeroed in one view or the other
  for b in range(batch):
    for k in range(heads):
      for parity in range(2):
        row = b * 2 * heads + 2 * k + parity
        zeros[row] = 6 if row in (1, 6) else 3  # rows 1 and 6 fall below m = 47
        picks = rng.choice(t * t, size=zeros[row], replace=False)
        for n, p in enumerate(picks):  # cells of layer `parity` (j = 0) of that sentence and head
          (att1 if n % 2 else att2)[parity, b, k, p // t, p % t] = 0.0
  m = cells - 3
  kept = {r: [c for c in range(cells) if not (c < t * t and _zeroed(att1, att2, r, c, heads, t))]
          for r in zeros if zeros[r] == 3}
  assert all(len(c) == m for c in kept.values()) and len(kept) == 6
  want = _torch_official(att1, att2, kept)
  ours = _jax_official(att1, att2, mask, jax.random.PRNGKey(0), m)
  np.testing.assert_allclose(ours[0], want[0], rtol=1e-4)
  _assert_grads_match(ours[1:], want[1:])
  # The dropped rows get no gradient at all: row 1 = sentence 0, head 0, layers 1 and 3;
  # row 6 = sentence 1, head 1, layers 0 and 2.
  for grad in ours[1:]:
    assert not np.any(grad[[1, 3], 0, 0]) and not np.any(grad[[0, 2], 1, 1])


def _zeroed(att1, att2, row, cell, heads, t):
  """Is `cell` (< T·T: layer j = 0) of official `row` zero in either view?"""
  b, rest = divmod(row, 2 * heads)
  k, parity = divmod(rest, 2)
  q, key = divmod(cell, t)
  return att1[parity, b, k, q, key] == 0 or att2[parity, b, k, q, key] == 0


def test_gradient_matches_torch_on_the_returned_random_sample():
  """m below the rows' valid counts: a random subset per kept row; padding and dropout zeros."""
  rng = np.random.default_rng(1)
  num_layers, heads, t, m = 4, 2, 6, 30
  lengths = [6, 4, 5]
  att1, att2, mask = _views(rng, num_layers, len(lengths), heads, t, lengths)
  att1 = np.where(rng.random(att1.shape) < 0.1, 0.0, att1 / 0.9).astype(np.float32)
  att2 = np.where(rng.random(att2.shape) < 0.1, 0.0, att2 / 0.9).astype(np.float32)
  att1[1, 1, 0] = 0.0  # sentence 1, head 0, parity 1: layer 1 all zero, 24 cells left -> dropped
  key = jax.random.PRNGKey(7)
  res = ami_official.official_attention_mutual_information(att1, att2, key, num_samples=m)
  x, y = (r.detach().numpy() for r in _official_rows(torch.tensor(att1), torch.tensor(att2)))
  counts = ((x > 0) & (y > 0)).sum(1)
  assert counts.min() < m <= counts.max()
  # Our slice s = parity·H + head; the official row of a sentence is 2·head + parity.
  order = [b * 2 * heads + 2 * k + parity for b in range(len(lengths)) for parity in range(2) for k in range(heads)]
  weight = np.asarray(res.weight).reshape(-1)
  indices = np.asarray(res.indices).reshape(len(order), -1)
  picked = np.asarray(res.sample_weight).reshape(len(order), -1) > 0
  kept = {row: indices[s][picked[s]] for s, row in enumerate(order) if weight[s] > 0}
  assert sorted(kept) == sorted(np.flatnonzero(counts >= m).tolist())  # the official keep rule
  for row, cells in kept.items():  # a fixed sample of m distinct valid cells per kept row
    assert len(set(cells.tolist())) == m and ((x[row, cells] > 0) & (y[row, cells] > 0)).all()
  want = _torch_official(att1, att2, kept)
  ours = _jax_official(att1, att2, mask, key, m)
  np.testing.assert_allclose(ours[0], want[0], rtol=1e-4)
  _assert_grads_match(ours[1:], want[1:])
