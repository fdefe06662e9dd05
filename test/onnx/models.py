"""Small PyTorch models of the families that ONNX models usually come from, with random weights, and their export."""
from __future__ import annotations

import torch
import torch.nn as nn

from test.onnx import quiet


class ResNetStyle(nn.Module):
    """Conv-BN-ReLU stem, max pool, two residual stages (the second downsamples with a 1x1 projection), average pool."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        self.b1 = nn.Sequential(nn.Conv2d(16, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                                nn.Conv2d(16, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16))
        self.b2 = nn.Sequential(nn.Conv2d(16, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                                nn.Conv2d(32, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32))
        self.proj = nn.Sequential(nn.Conv2d(16, 32, 1, 2, bias=False), nn.BatchNorm2d(32))
        self.fc = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = torch.relu(x + self.b1(x))
        x = torch.relu(self.proj(x) + self.b2(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class EncoderStyle(nn.Module):
    """A BERT-style encoder: token and position embeddings, two post-norm transformer layers with GELU, a pooler."""

    def __init__(self, vocab: int = 100, dim: int = 32, max_len: int = 128):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.norm = nn.LayerNorm(dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True, activation="gelu")
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.pool = nn.Linear(dim, dim)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = torch.arange(ids.shape[1]).unsqueeze(0)
        h = self.enc(self.norm(self.emb(ids) + self.pos(p)))
        return h, torch.tanh(self.pool(h[:, 0]))


class RecurrentStyle(nn.Module):
    """An LSTM followed by a bidirectional GRU and a linear head."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.gru = nn.GRU(16, 12, batch_first=True, bidirectional=True)
        self.head = nn.Linear(24, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(self.lstm(x)[0])[0])


class MobileNetStyle(nn.Module):
    """Depthwise separable blocks with ReLU6 and hardswish, a squeeze-and-excitation gate, an inverted residual."""

    def __init__(self, classes: int = 10):
        super().__init__()
        def dw(cin: int, cout: int, stride: int, act: type[nn.Module]) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False), nn.BatchNorm2d(cin), act(),
                                 nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout), act())
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish())
        self.b1, self.b2 = dw(16, 24, 2, nn.ReLU6), dw(24, 24, 1, nn.ReLU6)
        self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(24, 8, 1), nn.ReLU(), nn.Conv2d(8, 24, 1),
                                nn.Hardsigmoid())
        self.b3 = dw(24, 32, 2, nn.Hardswish)
        self.fc = nn.Sequential(nn.Dropout(0.2), nn.Linear(32, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.b1(self.stem(x))
        x = x + self.b2(x)
        x = self.b3(x * self.se(x))
        return self.fc(x.mean((2, 3)))


def build(name: str) -> tuple[nn.Module, callable]:
    """The model and a function of the batch size (and sequence length) that makes an example input."""
    torch.manual_seed(0)
    if name == "resnet": return ResNetStyle(), lambda b, s=32: torch.randn(b, 3, s, s)
    if name == "encoder": return EncoderStyle(), lambda b, s=16: torch.randint(0, 100, (b, s))
    if name == "recurrent": return RecurrentStyle(), lambda b, s=7: torch.randn(b, s, 8)
    if name == "mobilenet": return MobileNetStyle(), lambda b, s=32: torch.randn(b, 3, s, s)
    raise ValueError(name)


def export(name: str, path: str, batch: int, seq: int | None = None) -> list[torch.Tensor]:
    """Export the model with torch.onnx.export (the dynamo exporter, which uses onnxscript) for one input shape;
    returns the example inputs. Quiet: the exporter's log lines and warnings aren't printed."""
    model, make = build(name)
    model.eval()
    x = make(batch) if seq is None else make(batch, seq)
    with torch.no_grad(), quiet(): torch.onnx.export(model, (x,), path, dynamo=True, verbose=False, input_names=["x"])
    return [x]
