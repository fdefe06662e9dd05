"""The ResNet example against a torch.nn ResNet written here with torchvision's layout: its state dict loads into ours
key for key (through a .pth file read without torch), and the logits and gradients agree."""
from __future__ import annotations
import pathlib
import sys
import numpy as np
import torch
from fusegrad import Tensor, nn
from fusegrad.nn.state import get_parameters, get_state_dict, load_state_dict

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import resnet  # noqa: E402
sys.path.pop(0)

torch.set_num_threads(1)

class TBlock(torch.nn.Module):
    def __init__(self, cin, width, stride):
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(cin, width, 3, stride, 1, bias=False), torch.nn.BatchNorm2d(width)
        self.conv2, self.bn2 = torch.nn.Conv2d(width, width, 3, 1, 1, bias=False), torch.nn.BatchNorm2d(width)
        self.downsample = torch.nn.Sequential(torch.nn.Conv2d(cin, width, 1, stride, bias=False),
                                              torch.nn.BatchNorm2d(width)) if stride != 1 or cin != width else None
    def forward(self, x):
        out = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu(out + (self.downsample(x) if self.downsample is not None else x))

class TResNet(torch.nn.Module):
    def __init__(self, width=8, classes=10):
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(3, width, 7, 2, 3, bias=False), torch.nn.BatchNorm2d(width)
        cin = width
        for i in range(4):
            setattr(self, f"layer{i + 1}", torch.nn.Sequential(TBlock(cin, width * 2 ** i, 2 if i else 1)))
            cin = width * 2 ** i
        self.fc = torch.nn.Linear(cin, classes)
    def forward(self, x):
        x = torch.nn.functional.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        for i in range(1, 5): x = getattr(self, f"layer{i}")(x)
        return self.fc(x.mean((2, 3)))

def test_tiny_resnet_matches_torch(tmp_path):
    torch.manual_seed(0)
    ref = TResNet()
    with torch.no_grad():  # non-trivial running statistics
        for m in ref.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
    torch.save(ref.state_dict(), tmp_path / "r.pth")
    ours = resnet.ResNet(18, num_classes=10, width=8, blocks=[1, 1, 1, 1])
    assert set(get_state_dict(ours)) == set(ref.state_dict())
    resnet.load(ours, str(tmp_path / "r.pth"))
    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    ref.eval()
    with torch.no_grad(): r = ref(torch.tensor(x)).numpy()
    with Tensor.test(): got = ours(Tensor(x)).numpy()
    np.testing.assert_allclose(got, r, atol=1e-4, rtol=1e-4)
    # training mode: batch statistics; gradients of a few parameters
    ref.train()
    out = ref(torch.tensor(x))
    out.square().sum().backward()
    params = [ours.conv1.weight, ours.layer3[0].conv2.weight, ours.fc.weight]
    for p in params: p.requires_grad_(True)
    with Tensor.train():
        o = ours(Tensor(x))
        o.square().sum().backward()
    np.testing.assert_allclose(o.numpy(), out.detach().numpy(), atol=1e-4, rtol=1e-4)
    # batch statistics over 2 samples at 1x1 spatial size make these gradients ill-conditioned (torch's own float32
    # ones are off by 1e-4 of their scale), so they are compared with float64 torch, relative to their scale
    ref64 = TResNet().double()
    state = torch.load(tmp_path / "r.pth")
    ref64.load_state_dict({k: v.double() if v.is_floating_point() else v for k, v in state.items()})
    ref64.train()
    ref64(torch.tensor(x).double()).square().sum().backward()
    for p, rp in zip(params, [ref64.conv1.weight, ref64.layer3[0].conv2.weight, ref64.fc.weight]):
        g = rp.grad.numpy()
        np.testing.assert_allclose(p.grad.numpy(), g, atol=1e-3 * np.abs(g).max(), rtol=1e-3)

def test_tiny_resnet_sgd_momentum_steps_match_torch():
    """Training steps as bench_train times them: cross-entropy, backward, SGD with momentum; batch norm in training
    mode updates its running statistics on both sides."""
    torch.manual_seed(1)
    ref = TResNet()
    ours = resnet.ResNet(18, num_classes=10, width=8, blocks=[1, 1, 1, 1])
    load_state_dict(ours, {k: Tensor(v.numpy()) for k, v in ref.state_dict().items()})
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((4, 3, 32, 32)).astype(np.float32), rng.integers(0, 10, 4)
    opt = nn.optim.SGD(get_parameters(ours), lr=0.05, momentum=0.9)
    topt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    ref.train()
    for step in range(3):
        with Tensor.train():
            opt.zero_grad()
            loss = ours(Tensor(x)).sparse_categorical_crossentropy(Tensor(y.astype(np.int32)))
            loss.backward()
            opt.step()
        topt.zero_grad()
        tloss = torch.nn.functional.cross_entropy(ref(torch.tensor(x)), torch.tensor(y))
        tloss.backward()
        topt.step()
        np.testing.assert_allclose(loss.item(), tloss.item(), rtol=1e-4, err_msg=f"loss of step {step}")
    # (not layer4's weights: its batch statistics over 4 samples at 1x1 make them ill-conditioned, see above)
    sd = get_state_dict(ours)
    for name in ("conv1.weight", "layer1.0.conv2.weight", "fc.bias", "layer2.0.bn1.running_var"):
        want = ref.state_dict()[name].numpy()
        np.testing.assert_allclose(sd[name].numpy(), want, atol=1e-4 * np.abs(want).max(), rtol=1e-3, err_msg=name)

class TResNet18(torch.nn.Module):
    """ResNet-18 with torchvision's state-dict names, from TBlock."""
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(3, 64, 7, 2, 3, bias=False), torch.nn.BatchNorm2d(64)
        cin = 64
        for i in range(4):
            w = 64 * 2 ** i
            setattr(self, f"layer{i + 1}", torch.nn.Sequential(TBlock(cin, w, 2 if i else 1), TBlock(w, w, 1)))
            cin = w
        self.fc = torch.nn.Linear(512, 1000)
    def forward(self, x):
        x = torch.nn.functional.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        for i in range(1, 5): x = getattr(self, f"layer{i}")(x)
        return self.fc(x.mean((2, 3)))

def test_resnet18_training_gradients_match_float64(monkeypatch):
    """A training-mode ResNet-18 step at batch 16 on 64x64 images (its late convolutions over 4x4 and 2x2 images,
    kernels no smaller model has): every parameter's gradient against torch in float64, as a norm relative to the
    gradient's. Both models use SiLU for ReLU here: ReLU's derivative jumps at 0, and layer4's inputs to it include
    values a few millionths of the largest from zero, which float32 rounding (any summation order, torch's too) may put
    on either side; one such element flipped moves every gradient upstream of it by 0.3-1.5%. SiLU's gradient is
    continuous, so float32 rounding moves the gradients by rounding-sized amounts and a wrong kernel stands out."""
    monkeypatch.setattr(torch, "relu", torch.nn.functional.silu)
    monkeypatch.setattr(Tensor, "relu", Tensor.silu)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 3, 64, 64)).astype(np.float32)
    y = rng.integers(0, 1000, 16).astype(np.int32)
    Tensor.manual_seed(0)
    model = resnet.ResNet(18)
    ref = TResNet18()
    ref.load_state_dict({k: torch.tensor(v.numpy()) for k, v in get_state_dict(model).items()}, strict=False)
    ref = ref.double().train()
    with Tensor.train():
        model(Tensor(x)).sparse_categorical_crossentropy(Tensor(y)).backward()
    loss = torch.nn.functional.cross_entropy(ref(torch.tensor(x, dtype=torch.float64)), torch.tensor(y).long())
    loss.backward()
    ours = get_state_dict(model)
    errs = {n: np.linalg.norm(ours[n].grad.numpy() - p.grad.numpy()) / np.linalg.norm(p.grad.numpy())
            for n, p in ref.named_parameters()}
    assert np.median(list(errs.values())) < 5e-5, sorted(errs.items(), key=lambda kv: -kv[1])[:5]
    assert max(errs.values()) < 2e-4, sorted(errs.items(), key=lambda kv: -kv[1])[:5]
