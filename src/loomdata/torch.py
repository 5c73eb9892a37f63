"""The torch adapter, public: `loomdata.torch.LoomDataset` (an IterableDataset over a StreamClient)."""

from loomdata.client._torch import LoomDataset, batch_to_tensors

__all__ = ["LoomDataset", "batch_to_tensors"]
