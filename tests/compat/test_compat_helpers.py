"""Helpers ATorch scripts import: `atorch.common.util_func`, `atorch.common.log_utils`, `atorch.data`.

Behaviour from ATorch (dlrover bfd04ef1): `data_to_device(data, device)` moves every tensor of
a nested batch and is `auto_accelerate`'s default prepare_input; `expand_batch_dim(data, n)`
adds a leading batch dimension of n; `divide` insists on exact division.
"""

import logging
import socket
from collections import namedtuple

import pytest
import torch

from atorch.common.log_utils import default_logger
from atorch.common.util_func import data_to_device, divide, find_free_port
from atorch.data import data_to_device as data_to_device_from_data
from atorch.data import expand_batch_dim

Pair = namedtuple("Pair", "x y")


def test_data_to_device_keeps_structure_and_non_tensors():
    batch = {"ids": torch.arange(4), "pair": Pair(torch.ones(2), "text"), "list": [torch.zeros(1), 3]}
    moved = data_to_device(batch, torch.device("meta"))
    assert moved["ids"].device.type == "meta" and moved["pair"].x.device.type == "meta"
    assert isinstance(moved["pair"], Pair) and moved["pair"].y == "text" and moved["list"][1] == 3
    assert data_to_device_from_data is data_to_device
    assert data_to_device(torch.ones(2), "cpu").device.type == "cpu"


def test_expand_batch_dim():
    sample = {"input_ids": torch.tensor([1, 2, 3]), "label": torch.tensor(0), "name": "s"}
    batch = expand_batch_dim(sample, 4)
    assert batch["input_ids"].shape == (4, 3) and batch["label"].shape == (4,) and batch["name"] == "s"
    assert torch.equal(batch["input_ids"][3], sample["input_ids"])
    assert expand_batch_dim(torch.ones(2, 2)).shape == (1, 2, 2)
    with pytest.raises(ValueError, match="batch_size=0 must be an integer >= 1"):
        expand_batch_dim(sample, 0)


def test_divide_and_free_port():
    assert divide(12, 4) == 3
    with pytest.raises(ValueError, match="10 is not divisible by 4"):
        divide(10, 4)
    port = find_free_port()
    with socket.socket() as s:  # the port really is free
        s.bind(("127.0.0.1", port))


def test_default_logger_is_atorch_root_logger():
    """Configuring default_logger configures every atorch module's messages."""
    assert isinstance(default_logger, logging.Logger) and default_logger.name == "atorch"
    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Collect()
    default_logger.addHandler(handler)
    try:
        logging.getLogger("atorch.auto.accelerate").warning("from a module")
    finally:
        default_logger.removeHandler(handler)
    assert records == ["from a module"]
