"""A replica: a standby copy of one server's shards, fed the updates that server applies.

    python -m pytest tests/unit/test_ps.py -k replica

``register_as_replica(server)`` (MLfabric Table 1; by default replica ``i`` mirrors server
``i % S``, :class:`mlfabric.ps.layout.PSLayout`) asks the server for a copy: it sends each
model as it is then (values, version, and the rule's update history so that the next updates
give identical values), and afterwards every model it initialises and every update it
applies, in the order it applies them; the replica applies them with the same rule, so its
versions follow the server's exactly. That is chain
replication; MLfabric's bounded-divergence replication, scheduled by the network, and the
failover that promotes a replica are built on this by the replication issue.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING


import torch

from mlfabric.transport.base import Transport

from . import protocol
from .config import PSConfig
from .layout import PSLayout
from .model import ModelSpec
from .rules import SGDMomentum, UpdateInfo
from .server import UpdateCallback, payload_tensor

if TYPE_CHECKING:
    from .server import ParameterServer, ServerStats

#: Consistency models a replica takes over under: their clocks can be rebuilt from the
#: workers' own (a BSP round in flight at the lost server cannot).
FAILOVER_KINDS = ("async", "ssp")

log = logging.getLogger("mlfabric.ps")


class Replica:
    def __init__(self, transport: Transport, layout: PSLayout, config: PSConfig, *, server: int | None = None,
                 channel: str | None = None) -> None:
        self.transport, self.layout, self.config = transport, layout, config
        self.server = layout.replicated_server(transport.rank) if server is None else layout.server_rank(server)
        self.channel = channel or transport.channels[0]
        self.who = layout.describe(transport.rank)
        self.values: dict[str, torch.Tensor] = {}
        self.versions: dict[str, int] = {}
        self._rules: dict[str, UpdateCallback] = {}
        self._callbacks: dict[str | None, UpdateCallback] = {}
        self._registered = False
        self._specs: dict[str, tuple[ModelSpec, float, float]] = {}  # name -> (spec, lr, momentum)
        self.promoted: "ParameterServer | None" = None

    def register_as_replica(self, server: int | None = None) -> None:
        """Start mirroring ``server`` (default: this replica's server in the layout)."""
        if self._registered:
            raise RuntimeError(f"{self.who}: already replicates server {self.server}")
        if server is not None:
            self.server = self.layout.server_rank(server)
        self.transport.send(self.layout.server_rank(self.server), protocol.request_tag(self.config.session), b"",
                            meta=protocol.encode(op="register", server=self.server), channel=self.channel)
        self._registered = True

    def promote(self) -> "ParameterServer":
        """A server for this replica's shards, starting from the replica's models, versions and
        update histories (failover; the workers redirect to it, :class:`PSWorker`)."""
        from .server import ParameterServer, _Shard

        server = ParameterServer(self.transport, self.layout, self.config, server=self.server, channel=self.channel)
        for name, values in self.values.items():
            spec, lr, momentum = self._specs[name]
            offset, length = spec.shards(self.layout.servers)[self.server]
            shard = _Shard(spec, offset, length, values, self._rules[name], lr=lr, momentum=momentum)
            shard.version = self.versions[name]
            server.shards[name] = shard
        return server

    def register_update_callback(self, callback: UpdateCallback, model: str | None = None) -> None:
        """Must be the server's rule for the copies to stay equal."""
        self._callbacks[model] = callback

    def serve(self) -> "dict[str, int] | ServerStats":
        """Apply the server's updates until it ends; returns each model's version. If the
        server is lost under async or SSP with direct routing, take over (:meth:`promote`) and
        serve until the workers leave; returns the server statistics then. Registers first if
        :meth:`register_as_replica` was not called."""
        if not self._registered:
            self.register_as_replica()
        tag = protocol.tag(protocol.REPLICATE, self.config.session)
        server_rank = self.layout.server_rank(self.server)
        mailbox = self.transport.mailbox
        while True:
            version = mailbox.version
            while (msg := mailbox.take(self.channel, tag, server_rank)) is not None:
                header = protocol.decode(msg.meta)
                if header["op"] == "end":
                    return dict(self.versions)
                self._apply(header, msg.payload)
            if server_rank in self.transport.lost_peers:
                if self.config.consistency.kind in FAILOVER_KINDS and self.config.routing == "direct":
                    log.warning("%s: server %d was lost; taking over its shards at versions %s", self.who,
                                self.server, self.versions)
                    self.promoted = self.promote()
                    return self.promoted.serve()
                log.warning("%s: server %d was lost; no failover under %s/%s routing: the replica holds "
                            "versions %s", self.who, self.server, self.config.consistency, self.config.routing,
                            self.versions)
                return dict(self.versions)
            if server_rank in self.transport.departed_peers:
                return dict(self.versions)
            self.transport.progress(version, 0.1)

    def _apply(self, header: dict, payload: memoryview) -> None:
        if header["op"] == "init":
            spec = ModelSpec.from_json(header["spec"])
            _, length = spec.shards(self.layout.servers)[self.server]
            with_history = bool(header.get("history"))
            data = payload_tensor(payload, spec.torch_dtype, 2 * length if with_history else length, "replica init")
            self.values[spec.name] = data[:length].clone()
            self._specs[spec.name] = (spec, float(header["lr"]), float(header["momentum"]))
            self.versions[spec.name] = int(header.get("version", 0))
            rule = self._callbacks.get(spec.name) or self._callbacks.get(None)
            if rule is None:
                rule = SGDMomentum(float(header["lr"]), float(header["momentum"]))
                if with_history:
                    rule.history = data[length:].clone()
            self._rules[spec.name] = rule
            return
        name = header["model"]
        values = self.values[name]
        if int(header["version"]) != self.versions[name]:
            raise RuntimeError(f"{self.who}: update {header['version']} of {name!r} arrived at version "
                               f"{self.versions[name]}: the server's order was not kept")
        gradient = payload_tensor(payload, values.dtype, values.numel(), "replicated update")
        info = UpdateInfo(model=name, server=self.server, version=self.versions[name],
                          workers=tuple(header["workers"]), computed_from=tuple(header["computed_from"]),
                          weight=float(header["weight"]))
        self._rules[name](values, gradient, info)
        self.versions[name] += 1


