"""Mixture-of-experts models as fsdp_int8 finds them (private): :mod:`.layout` (which
parameters are experts, stored which way round, and which modules route), read from the
modules alone, for transformers 5 and torchtitan."""
