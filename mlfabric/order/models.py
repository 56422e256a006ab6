"""TicTac's benchmark models (§6), sized for a CPU, on synthetic inputs.

    .venv/bin/python -c "from mlfabric.order.models import build; m, x = build('par32'); print(m(*x).shape)"

Each builder returns ``(model, example_inputs)`` with weights drawn under ``seed``:

========= ==================================================== ============== ======= ======
name      structure                                            input          params  recvs
========= ==================================================== ============== ======= ======
par32     32 independent bias-free Linear(64, 64) branches on  (8, 64)        131,072     32
          one input, stacked and summed in one op
seq32     32 x [bias-free Linear(64, 64), tanh], a chain       (8, 64)        131,072     32
inception stem conv3x3 + 2 Inception blocks (1x1 / 1x1-3x3 /   (4, 3, 32, 32)  24,278     32
          1x1-3x3-3x3 / maxpool-1x1, concatenated) + FC
vgg       VGG-style: 3 x [conv3x3, conv3x3, maxpool] + 2 FC    (4, 3, 32, 32) 337,050     16
alexnet   AlexNet-style: 5 convs (3 maxpools) + 3 FC           (4, 3, 32, 32) 578,250     16
========= ==================================================== ============== ======= ======

Parameters are float32 (bytes = 4 x params); the counts are asserted in
tests/unit/test_order_dag.py.

Par-32 and Seq-32 are the paper's extreme toys: in Par-32 every branch needs one recv and
is otherwise identical, so every transfer order gives the same makespan; in Seq-32 layer
``i`` needs recv ``i`` and layer ``i-1``, so (with compute and transfer balanced) exactly
one order, ``w_0, w_1, ...``, is best. Their layers have no bias so that one recv stands
for one layer (with biases, a weight and its bias could swap at no cost and "exactly one
best order" would not hold). The three CNNs keep biases, like their originals, and no
batch norm (its running statistics are buffers the PS does not hold).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

__all__ = ["MODELS", "build", "param_bytes", "param_count"]

WIDTH = 64


class Par(nn.Module):
    """``n`` independent Linear branches on one input; one op joins them all."""

    def __init__(self, n: int = 32, width: int = WIDTH) -> None:
        super().__init__()
        self.branches = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # stack + sum is one join op depending on every branch; a chain of adds would order
        # the branches (add_k needs branches 0..k) and break "all orders are equal".
        return torch.stack([b(x) for b in self.branches]).sum(0)


class Seq(nn.Module):
    """A chain of ``n`` bias-free Linear + tanh layers."""

    def __init__(self, n: int = 32, width: int = WIDTH) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class InceptionBlock(nn.Module):
    """Four branches (InceptionV2 style: the 5x5 is two 3x3), concatenated on channels."""

    def __init__(self, cin: int, b1: int, b3r: int, b3: int, b5r: int, b5: int, bp: int) -> None:
        super().__init__()
        self.b1 = nn.Conv2d(cin, b1, 1)
        self.b3r = nn.Conv2d(cin, b3r, 1)
        self.b3 = nn.Conv2d(b3r, b3, 3, padding=1)
        self.b5r = nn.Conv2d(cin, b5r, 1)
        self.b5a = nn.Conv2d(b5r, b5, 3, padding=1)
        self.b5b = nn.Conv2d(b5, b5, 3, padding=1)
        self.pool = nn.MaxPool2d(3, stride=1, padding=1)
        self.bp = nn.Conv2d(cin, bp, 1)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.act(self.b1(x))
        b = self.act(self.b3(self.act(self.b3r(x))))
        c = self.act(self.b5b(self.act(self.b5a(self.act(self.b5r(x))))))
        d = self.act(self.bp(self.pool(x)))
        return torch.cat([a, b, c, d], dim=1)


class Inception(nn.Module):
    def __init__(self, classes: int = 10, width: int = 1) -> None:
        super().__init__()
        w = width
        self.stem = nn.Conv2d(3, 32 * w, 3, padding=1)
        self.act = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.block1 = InceptionBlock(32 * w, *(c * w for c in (16, 16, 24, 8, 12, 12)))  # -> 64 w channels
        self.block2 = InceptionBlock(64 * w, *(c * w for c in (24, 24, 32, 8, 16, 16)))  # -> 88 w channels
        self.fc = nn.Linear(88 * w, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.act(self.stem(x)))
        x = self.pool(self.block1(x))
        x = self.block2(x)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def _vgg(classes: int = 10, width: int = 1) -> nn.Module:
    layers: list[nn.Module] = []
    cin = 3
    for cout in (16 * width, 32 * width, 64 * width):
        layers += [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(), nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU(),
                   nn.MaxPool2d(2)]
        cin = cout
    layers += [nn.Flatten(), nn.Linear(cin * 4 * 4, 256), nn.ReLU(), nn.Linear(256, classes)]
    return nn.Sequential(*layers)


def _alexnet(classes: int = 10, width: int = 1) -> nn.Module:
    c1, c2, c3, c5 = (c * width for c in (32, 64, 96, 64))
    return nn.Sequential(
        nn.Conv2d(3, c1, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),  # 16x16
        nn.Conv2d(c1, c2, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),  # 8x8
        nn.Conv2d(c2, c3, 3, padding=1), nn.ReLU(),
        nn.Conv2d(c3, c3, 3, padding=1), nn.ReLU(),
        nn.Conv2d(c3, c5, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 4x4
        # Like the original, the fully connected layers hold most of the parameters.
        nn.Flatten(), nn.Linear(c5 * 4 * 4, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, classes),
    )


def _image(batch: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch, 3, 32, 32, generator=g),)


#: Builders by name; each takes ``width``, a channel multiplier for the CNNs (1 = the table
#: above; ``width`` w has about w^2 times the conv parameters) and the branch width / 64 for
#: Par-32 and Seq-32.
MODELS: dict[str, Callable[[int], nn.Module]] = {
    "par32": lambda width: Par(32, WIDTH * width),
    "seq32": lambda width: Seq(32, WIDTH * width),
    "inception": lambda width: Inception(width=width),
    "vgg": lambda width: _vgg(width=width),
    "alexnet": lambda width: _alexnet(width=width),
}


def build(name: str, *, seed: int = 0, batch: int | None = None,
          width: int = 1) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The model ``name`` (see :data:`MODELS`) in eval mode and a synthetic input batch;
    ``width`` scales its channels (parameters about x width^2: a bigger transfer per op)."""
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    torch.manual_seed(seed)
    model = MODELS[name](width).eval()
    g = torch.Generator().manual_seed(seed + 1)
    if name in ("par32", "seq32"):
        inputs: tuple[torch.Tensor, ...] = (torch.randn(batch or 8, WIDTH * width, generator=g),)
    else:
        inputs = _image(batch or 4, g)
    return model, inputs


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())
