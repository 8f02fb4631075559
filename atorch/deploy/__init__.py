"""Serve a tensor-parallel model from a plain single process: `atorch.deploy(model, tensor_parallel_size=2)`."""

from atorch.deploy.launcher import deploy
from atorch.deploy.proxy import DeployedModel, WorkerError

__all__ = ["DeployedModel", "WorkerError", "deploy"]
