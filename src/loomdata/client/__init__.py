"""The client stage: StreamClient (a rank's iterator over its batches) and its checkpoint state.

The resume checker that used to live here is `loomdata.testing.verify_resume`.
"""

from loomdata.client._state import STATE_VERSION, StreamState
from loomdata.client._stream import StreamClient

__all__ = ["STATE_VERSION", "StreamClient", "StreamState"]
