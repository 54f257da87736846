"""Studies: sweeps of training runs (methods × sizes × seeds) on submitit, tables and figures."""
