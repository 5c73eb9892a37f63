"""Stub (see the package docstring)."""


class VisionDataset:
    """Stub base class."""


class CIFAR10(VisionDataset):
    """Stub."""
