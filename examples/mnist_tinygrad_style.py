"""A small convolutional network trained on MNIST, written the way tinygrad programs are: tinygrad's names only
(`function`, `Context(TRAINING=1)`, `Tensor.randint(n, high=...)`, `loss.realize(*opt.schedule_step())`, `trange`,
`mnist(fashion=...)`), so the same file runs on tinygrad with `fusegrad` replaced by `tinygrad` in its imports.

    .venv/bin/python examples/mnist_tinygrad_style.py               # MNIST, downloaded into the cache on first use
    FASHION=1 STEPS=200 BS=128 .venv/bin/python examples/mnist_tinygrad_style.py
"""
from fusegrad import Context, GlobalCounters, Tensor, TinyJit, function, nn
from fusegrad.helpers import colored, getenv, trange
from fusegrad.nn.datasets import mnist

class SmallConvNet:
    def __init__(self, width: int = 8):
        self.conv1, self.norm1 = nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm(width)
        self.conv2, self.norm2 = nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm(2 * width)
        self.head = nn.Linear(2 * width * 7 * 7, 10)

    @function
    def __call__(self, images: Tensor) -> Tensor:
        x = (images.float() / 255.0 - 0.5) / 0.5
        x = self.norm1(self.conv1(x)).relu().max_pool2d()
        x = self.norm2(self.conv2(x)).relu().max_pool2d()
        return self.head(x.flatten(1))

def train(steps: int, batch: int, fashion: bool) -> float:
    """Train for `steps` steps of `batch` images; the test accuracy in percent at the end."""
    X_train, Y_train, X_test, Y_test = mnist(fashion=fashion)
    model = SmallConvNet()
    opt = nn.optim.Adam(nn.state.get_parameters(model), lr=3e-3)

    @TinyJit
    @Context(TRAINING=1)
    def train_step() -> Tensor:
        opt.zero_grad()
        picked = Tensor.randint(batch, high=X_train.shape[0])
        loss = model(X_train[picked]).sparse_categorical_crossentropy(Y_train[picked]).backward()
        return loss.realize(*opt.schedule_step())

    @TinyJit
    def test_accuracy() -> Tensor: return (model(X_test).argmax(axis=1) == Y_test).mean() * 100

    accuracy = float("nan")
    for i in (bar := trange(steps)):
        GlobalCounters.reset()
        loss = train_step()
        if i % 20 == 19 or i == steps - 1: accuracy = test_accuracy().item()
        bar.set_description(f"loss {loss.item():6.3f}  test accuracy {accuracy:5.2f}%  "
                            f"{GlobalCounters.global_ops * 1e-9:.2f} GOPS a step")
    return accuracy

if __name__ == "__main__":
    final = train(getenv("STEPS", 100), getenv("BS", 128), bool(getenv("FASHION")))
    print(colored(f"test accuracy {final:.2f}%", "green" if final > 90 else "yellow"))
