"""A stand-in for torchvision in the peers' venv: Mosaic Streaming imports it at import time, and PyPI's
torchvision does not load next to the CPU torch here. Only the names it imports exist; none is used
on the token path the benchmark reads."""
