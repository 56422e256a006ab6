"""Transports: tagged byte messages to a peer over a named channel.

``local`` (threads in one process), ``zmq`` (TCP, one address per channel) and
``torchdist`` (torch.distributed isend/irecv on gloo or NCCL).
"""

from .base import CONTROL_CHANNEL, LinkCounters, Mailbox, Message, SendHandle, Transport
from .local import LocalFabric, LocalTransport

__all__ = [
    "CONTROL_CHANNEL", "LinkCounters", "LocalFabric", "LocalTransport", "Mailbox", "Message",
    "SendHandle", "Transport",
]
