"""loomdata: multi-source, cost-balanced training data planned globally and streamed on Dask."""

__version__ = "0.1.0"
