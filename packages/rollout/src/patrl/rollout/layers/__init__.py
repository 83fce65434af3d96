"""Tensor-parallel building blocks of the rollout models; each parameter loads itself."""
