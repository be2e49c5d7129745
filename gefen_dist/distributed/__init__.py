"""What the optimizer needs of ``torch.distributed`` with no framework integration: the pieces a
rank holds of DTensor parameters (``sharding``) and the agreements the ranks reach at the first
step (``collectives``)."""
