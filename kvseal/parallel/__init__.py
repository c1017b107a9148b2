"""Tensor parallelism: one model over several processes, the isolation contract held on every rank."""
