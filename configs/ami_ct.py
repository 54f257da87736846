"""AMI on top of Contrastive Tension (miCSE Tab. 2): AMI between the two encoders' attention."""
from configs import ct


def get_config(arg=None):
  c = ct.get_config(arg)
  c.ami.enabled = True
  return c
