"""miCSE: SimCSE + attention mutual information (AMI) + momentum encoder with a negative queue."""
from configs import default


def get_config(arg=None):
  return default.get_config(arg)
