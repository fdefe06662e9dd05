"""ResNet-18/50 forward and a training step, with torchvision's module layout and state-dict names.

    .venv/bin/python examples/resnet.py --depth 18 --batch 8 --size 224
    .venv/bin/python examples/resnet.py --depth 50 --weights resnet50.pth    # torchvision .pth or .safetensors
"""
from __future__ import annotations
import argparse
import time
from fusegrad import Tensor, TinyJit, nn
from fusegrad.nn.state import get_parameters, load_state_dict, safe_load, torch_load

class BasicBlock:
    expansion = 1
    def __init__(self, cin: int, width: int, stride: int = 1):
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width)
        self.downsample = [nn.Conv2d(cin, width, 1, stride, bias=False), nn.BatchNorm2d(width)] \
            if stride != 1 or cin != width else []

    def __call__(self, x: Tensor) -> Tensor:
        out = self.bn2(self.conv2(self.bn1(self.conv1(x)).relu()))
        return (out + (x.sequential(self.downsample) if self.downsample else x)).relu()

class Bottleneck:
    expansion = 4
    def __init__(self, cin: int, width: int, stride: int = 1):
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, width * 4, 1, bias=False), nn.BatchNorm2d(width * 4)
        self.downsample = [nn.Conv2d(cin, width * 4, 1, stride, bias=False), nn.BatchNorm2d(width * 4)] \
            if stride != 1 or cin != width * 4 else []

    def __call__(self, x: Tensor) -> Tensor:
        out = self.bn1(self.conv1(x)).relu()
        out = self.bn2(self.conv2(out)).relu()
        out = self.bn3(self.conv3(out))
        return (out + (x.sequential(self.downsample) if self.downsample else x)).relu()

class ResNet:
    """torchvision's ResNet: conv1/bn1, max pool, layer1..layer4, average pool, fc."""
    def __init__(self, depth: int = 18, num_classes: int = 1000, width: int = 64, blocks: list[int] | None = None):
        block, default = {18: (BasicBlock, [2, 2, 2, 2]), 34: (BasicBlock, [3, 4, 6, 3]),
                          50: (Bottleneck, [3, 4, 6, 3]), 101: (Bottleneck, [3, 4, 23, 3])}[depth]
        blocks = blocks or default
        self.conv1, self.bn1 = nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width)
        cin = width
        for i, n in enumerate(blocks):
            layer = []
            for j in range(n):
                layer.append(block(cin, width * 2 ** i, 2 if j == 0 and i > 0 else 1))
                cin = width * 2 ** i * block.expansion
            setattr(self, f"layer{i + 1}", layer)
        self.fc = nn.Linear(cin, num_classes)

    def __call__(self, x: Tensor) -> Tensor:
        x = self.bn1(self.conv1(x)).relu().max_pool2d(3, 2, padding=1)
        for i in range(1, 5): x = x.sequential(getattr(self, f"layer{i}"))
        return self.fc(x.mean((2, 3)))

def load(model: ResNet, fn: str) -> None:
    """Load torchvision weights from a .pth (read without torch) or .safetensors file."""
    load_state_dict(model, safe_load(fn) if fn.endswith(".safetensors") else torch_load(fn), strict=False)

def main() -> None:
    ap = argparse.ArgumentParser(description="ResNet forward and training-step speed")
    ap.add_argument("--depth", type=int, default=18, choices=[18, 34, 50, 101])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--weights", help="torchvision weights (.pth or .safetensors)")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    model = ResNet(args.depth)
    if args.weights: load(model, args.weights)
    x = Tensor.randn(args.batch, 3, args.size, args.size).realize()

    @TinyJit
    def forward(img: Tensor) -> Tensor:
        with Tensor.test(): return model(img)
    times = []
    for i in range(args.iters + 2):
        st = time.perf_counter()
        out = forward(x).realize()
        times.append(time.perf_counter() - st)
        if i == 0: print(f"first forward (compiles): {times[0]:.2f} s")
    steady = min(times[2:])
    print(f"ResNet-{args.depth} forward: {args.batch / steady:.1f} images/s (batch {args.batch}, {args.size}px), "
          f"top class of image 0: {out[0].argmax().item()}")
    opt = nn.optim.SGD(get_parameters(model), lr=0.01, momentum=0.9)
    labels = Tensor.randint(args.batch, high=1000)
    st = time.perf_counter()
    with Tensor.train():
        opt.zero_grad()
        loss = model(x).sparse_categorical_crossentropy(labels)
        loss.backward()
        opt.step()
    print(f"one SGD training step: loss {loss.item():.3f}, {time.perf_counter() - st:.2f} s (includes compiling)")

if __name__ == "__main__":
    main()
