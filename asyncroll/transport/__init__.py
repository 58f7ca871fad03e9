"""Weight-push transport: the trainer's named tensors into engine worker processes.

Double-buffered and bucketed over shared staging memory (``shm`` or ``cuda_ipc``), with a
ZeroMQ ``ipc://`` control channel authenticated by a per-job secret. Independent of vLLM.
The sender's side, one concept a module: ``sender`` (the ``WeightSender`` facade),
``pipeline`` (the per-bucket hot path), ``staging`` (the buffers), ``pushes`` (one push's state
and End), ``waits`` (waits on the device), ``peers`` (the control plane), ``wire`` (messages).

```python
async with open_weight_sender(receivers=2) as sender:
    config = sender.receiver_config()       # hand to each receiver process (json-able)
    report = await sender.push(model.state_dict(), version=step)

# in each receiver process (blocking API)
receiver = WeightReceiver.from_config(config, name="tp0")
receiver.connect()
receiver.receive(lambda batch: model.load_weights(batch))   # views valid only during the call
receiver.close()
```
"""

from asyncroll.transport.backends import Backend, CudaIpcBackend, ShmBackend
from asyncroll.transport.lazy import LazyTensor
from asyncroll.transport.piece import Piece
from asyncroll.transport.plan import Bucket, Part, Slot, TensorMeta, default_group, plan_buckets
from asyncroll.transport.receiver import (
    LoadFn,
    ReceiverBucketTimes,
    ReceiveReport,
    ReceiverStatistics,
    WeightReceiver,
)
from asyncroll.transport.sender import (
    PushReport,
    SenderBucketTimes,
    SenderStatistics,
    WeightSender,
    open_weight_sender,
)

__all__ = [
    "Backend",
    "Bucket",
    "CudaIpcBackend",
    "LazyTensor",
    "LoadFn",
    "Part",
    "Piece",
    "PushReport",
    "ReceiveReport",
    "ReceiverBucketTimes",
    "ReceiverStatistics",
    "SenderBucketTimes",
    "SenderStatistics",
    "ShmBackend",
    "Slot",
    "TensorMeta",
    "WeightReceiver",
    "WeightSender",
    "default_group",
    "open_weight_sender",
    "plan_buckets",
]
