"""The client stage: StreamClient (a rank's iterator over its batches), its checkpoint state, a resume check."""

from loomdata.client._state import STATE_VERSION, StreamState
from loomdata.client._stream import StreamClient
from loomdata.client._verify import verify_resume

__all__ = ["STATE_VERSION", "StreamClient", "StreamState", "verify_resume"]
