"""Config fields of the relatives of miCSE (issue 7), added to every config by `default`.

Each group switches one view or loss term of the one train step (`micse_jax/training/step.py`);
all are off by default, so the four original objectives are unchanged.
"""
import os

import ml_collections


def add_method_fields(c: ml_collections.ConfigDict, shared_data: str) -> None:
  """Adds the `view`, `ct`, `mlm`, `reconstruction`, `infocse` and `analysis` groups."""
  c.loss.objective = "infonce"        # infonce | positive_only (miCSE App. E: no negatives)
  c.ami.variant = "paper"             # paper | official (SAP-samples/acl2023-micse slicing)
  c.model.init_mlm_head = False       # allow a random MLM head when the checkpoint has none

  c.view = ml_collections.ConfigDict()
  c.view.kind = "dropout"             # second view: dropout | add | span_mask
  c.view.add_importance = "naive"     # ADD token importance: naive | rollout
  c.view.add_mode = "static"          # ADD: static (k tokens if n >= t) | dynamic (k = n // t)
  c.view.add_k = 1
  c.view.add_threshold = 10           # t
  c.view.span_length = 5              # Mirror-BERT random span masking length

  c.ct = ml_collections.ConfigDict()
  c.ct.enabled = False                # Contrastive Tension: two independent encoders

  c.mlm = ml_collections.ConfigDict()
  c.mlm.enabled = False               # SimCSE's do_mlm auxiliary on a masked copy
  c.mlm.weight = 0.1                  # β (SimCSE's mlm_weight)
  c.mlm.prob = 0.15

  c.reconstruction = ml_collections.ConfigDict()
  c.reconstruction.enabled = False    # InforMin-CL L_R = E||z1 - z2||^2 (Eq. 8-9)
  c.reconstruction.weight = 0.4       # λ for BERT-base
  c.reconstruction.normalize = False  # True: L2-normalised z, as in the public code

  c.infocse = ml_collections.ConfigDict()
  c.infocse.enabled = False           # auxiliary MLM network fed by the online [CLS]
  c.infocse.weight = 1e-5             # λ of the public recipe (mlm_weight 0.00001)
  c.infocse.mask_prob = 0.4           # the public recipe's mlm_rate
  c.infocse.num_layers = 2            # new transformer layers of the auxiliary network
  c.infocse.pretrain_steps = 0        # InfoCSE §3.1: first N steps train only the aux network

  c.analysis = ml_collections.ConfigDict()
  c.analysis.enabled = True           # alignment / uniformity / attention MI every eval_every
  c.analysis.corpus = os.path.join(shared_data, "corpus", "english_mix.txt")
  c.analysis.first_line = 11914       # after the wiki1m lines: held out from training
  c.analysis.num_sentences = 256
