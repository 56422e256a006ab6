"""A model as the parameter server sees it: named tensors, one flat vector, sharded over servers.

    python -m pytest tests/unit/test_ps.py -k spec

A model (``ModelSpec``) is an ordered list of named tensors of one dtype. Its tensors are
concatenated in registration order into one flat vector, and the vector is cut into S
contiguous ranges, one per server, whose lengths differ by at most one element (the rule of
``collectives.partition``, ``torch.tensor_split``'s). So the shards are balanced to one
element whatever the tensor sizes are (a model with one huge embedding and many small
biases still splits evenly), a push to server ``j`` is one message (the slice of the flat
gradient), and a tensor may straddle two servers. MLfabric §10.2 treats a model split over
servers exactly so: an update has one component per server, computed from the same model.

One dtype per model keeps a shard one contiguous buffer; register tensors of another dtype
(LDA's integer counts next to float weights) as a model of their own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping, Sequence, Union

import torch

from mlfabric.collectives.partition import piece_offsets, piece_sizes

Tensors = Union[Mapping[str, torch.Tensor], Sequence[torch.Tensor], torch.nn.Module, torch.Tensor]

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.int16, torch.int8,
    torch.uint8)}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def named_tensors(tensors: Tensors) -> list[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` in order: a module's trainable parameters, a mapping's items, a
    sequence's items keyed ``"0"``, ``"1"``, ... or a single tensor keyed ``"0"``."""
    if isinstance(tensors, torch.nn.Module):
        return [(k, p) for k, p in tensors.named_parameters() if p.requires_grad]
    if isinstance(tensors, torch.Tensor):
        return [("0", tensors)]
    if isinstance(tensors, Mapping):
        return [(str(k), v) for k, v in tensors.items()]
    return [(str(i), t) for i, t in enumerate(tensors)]


@dataclass(frozen=True)
class TensorSpec:
    key: str
    shape: tuple[int, ...]
    offset: int  # in the flat vector

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ModelSpec:
    """The layout of one model: ``name``, its tensors in order, their dtype."""

    name: str
    tensors: tuple[TensorSpec, ...]
    dtype: str

    @classmethod
    def of(cls, name: str, tensors: Tensors) -> "ModelSpec":
        if not name or not isinstance(name, str):
            raise ValueError(f"a model needs a non-empty string name, got {name!r}")
        items = named_tensors(tensors)
        if not items:
            raise ValueError(f"model {name!r} has no tensors")
        keys = [k for k, _ in items]
        if len(set(keys)) != len(keys):
            raise ValueError(f"model {name!r} has repeated keys: {keys}")
        dtypes = {t.dtype for _, t in items}
        if len(dtypes) != 1:
            raise ValueError(f"model {name!r} mixes dtypes {sorted(map(dtype_name, dtypes))}: a model's shards are "
                             "one flat buffer; register the tensors of each dtype as a model of their own")
        dtype = dtypes.pop()
        if dtype_name(dtype) not in _DTYPES:
            raise TypeError(f"model {name!r}: dtype {dtype} is not supported by the parameter server")
        specs, offset = [], 0
        for key, t in items:
            specs.append(TensorSpec(key, tuple(t.shape), offset))
            offset += t.numel()
        return cls(name, tuple(specs), dtype_name(dtype))

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def keys(self) -> list[str]:
        return [t.key for t in self.tensors]

    def flatten(self, tensors: Tensors, *, who: str, op: str) -> torch.Tensor:
        """One flat CPU tensor of ``tensors``, checked against this spec: keys, shapes and
        dtype; the error names ``who`` (the caller), the key and what was expected."""
        if isinstance(tensors, torch.Tensor):
            # One tensor: the model's only tensor (keyed as registered), or the flat vector.
            if len(self.tensors) == 1 and tuple(tensors.shape) == self.tensors[0].shape:
                items = [(self.tensors[0].key, tensors)]
            elif tensors.dim() == 1 and tensors.numel() == self.numel:
                items = None
            else:
                raise ValueError(f"{who}: {op} of model {self.name!r}: a tensor of shape {tuple(tensors.shape)} is "
                                 f"neither the flat vector ({self.numel},) nor a mapping of the keys {self.keys}")
        else:
            items = named_tensors(tensors)
        if items is None:
            flat = tensors  # type: ignore[assignment]
            self._check_dtype(flat.dtype, "<flat>", who, op)
            return flat.detach().to("cpu").reshape(-1).clone()
        given = dict(items)
        unknown = [k for k in given if k not in {t.key for t in self.tensors}]
        if unknown:
            raise KeyError(f"{who}: {op} of model {self.name!r}: unknown key {unknown[0]!r}; "
                           f"the model's keys are {self.keys}")
        missing = [t.key for t in self.tensors if t.key not in given]
        if missing:
            raise KeyError(f"{who}: {op} of model {self.name!r}: key {missing[0]!r} is missing; every key of "
                           f"{self.keys} must be given")
        parts = []
        for spec in self.tensors:
            t = given[spec.key]
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{who}: {op} of model {self.name!r}, key {spec.key!r}: expected a tensor, "
                                f"got {type(t).__name__}")
            if tuple(t.shape) != spec.shape:
                raise ValueError(f"{who}: {op} of model {self.name!r}, key {spec.key!r}: shape {tuple(t.shape)}, "
                                 f"expected {spec.shape}")
            self._check_dtype(t.dtype, spec.key, who, op)
            parts.append(t.detach().to("cpu").reshape(-1))
        return torch.cat(parts) if len(parts) > 1 else parts[0].clone()

    def _check_dtype(self, dtype: torch.dtype, key: str, who: str, op: str) -> None:
        if dtype_name(dtype) != self.dtype:
            raise TypeError(f"{who}: {op} of model {self.name!r}, key {key!r}: dtype {dtype_name(dtype)}, "
                            f"expected {self.dtype}")

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``flat`` shaped like the model's tensors."""
        return {t.key: flat[t.offset:t.offset + t.numel].view(t.shape) for t in self.tensors}

    def shards(self, servers: int) -> list[tuple[int, int]]:
        """``(offset, length)`` of each server's range of the flat vector (module docstring)."""
        return list(zip(piece_offsets(self.numel, servers), piece_sizes(self.numel, servers)))

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "dtype": self.dtype,
                           "tensors": [[t.key, list(t.shape)] for t in self.tensors]})

    @classmethod
    def from_json(cls, text: str) -> "ModelSpec":
        data = json.loads(text)
        specs, offset = [], 0
        for key, shape in data["tensors"]:
            spec = TensorSpec(key, tuple(shape), offset)
            specs.append(spec)
            offset += spec.numel
        return cls(data["name"], tuple(specs), data["dtype"])
