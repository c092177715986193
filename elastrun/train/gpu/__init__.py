"""The snapshot pipeline's GPU half: copies between a GPU and node memory at the card's speed.

* ``device.py``: the seam: streams, events, copies and page-locking, on CUDA (:class:`CudaDevice`)
  or on a stand-in that tests drive by hand;
* ``copy.py``: one snapshot's device-to-host copy on a side stream (:class:`DeviceCopy`), through a
  staging buffer on the device when the card has room for one;
* ``load.py``: host-to-device restores through page-locked staging buffers.

Nothing here imports CUDA state at import time; a CPU-only job never touches it.
"""
