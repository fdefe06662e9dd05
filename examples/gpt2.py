"""GPT-2 inference with a KV cache, decoding one token per TinyJit replay.

    .venv/bin/python examples/gpt2.py --weights model.safetensors --prompt "Hello" --count 20
    .venv/bin/python examples/gpt2.py --random --count 20          # the real 124M shape with random weights

The KV cache has room for the model's context. A decoding step at position `pos` writes its key and value into row
`pos` and attends to rows 0..pos: the position is a bound Variable, so those shapes are symbolic, every position runs
the same compiled kernels (looping over pos+1 rows, not the whole cache), and after its first two calls TinyJit
replays them for every token with the new value of the Variable (no tracing, scheduling or compiling per token)."""
from __future__ import annotations
import argparse
import heapq
import math
import random
import time
from dataclasses import dataclass
from fusegrad import Tensor, TinyJit, Variable, dtypes, nn
from fusegrad.uop.ops import UOp
from fusegrad.nn.state import get_state_dict, load_state_dict, safe_load

@dataclass(frozen=True)
class Config:
    n_layer: int = 12
    n_head: int = 12
    dim: int = 768
    vocab_size: int = 50257
    max_context: int = 1024
    norm_eps: float = 1e-5

class Attention:
    def __init__(self, cfg: Config, batch: int):
        self.c_attn, self.c_proj = nn.Linear(cfg.dim, 3 * cfg.dim), nn.Linear(cfg.dim, cfg.dim)
        self.n_head, self.head_dim = cfg.n_head, cfg.dim // cfg.n_head
        shape = (batch, cfg.max_context, cfg.n_head, self.head_dim)
        self.cache_k = Tensor.zeros(*shape).contiguous().realize()
        self.cache_v = Tensor.zeros(*shape).contiguous().realize()

    def __call__(self, x: Tensor, start: int | UOp | None) -> Tensor:
        """x (B, T, dim) at positions start..start+T-1 (start: an int, or a bound Variable); start None: positions
        0..T-1 without the cache (training: the cache's in-place writes would cut the gradient's path to k and v)."""
        B, T, dim = x.shape
        q, k, v = self.c_attn(x).reshape(B, T, 3, self.n_head, self.head_dim).chunk(3, dim=2)
        q, k, v = q.squeeze(2), k.squeeze(2), v.squeeze(2)
        if start is None:
            att = q.transpose(1, 2).scaled_dot_product_attention(k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            return self.c_proj(att.transpose(1, 2).reshape(B, T, dim))
        # the new rows go into the cache in place; attention reads rows 0..start+T-1 of it
        self.cache_k[:, start:start + T].assign(k).realize()
        self.cache_v[:, start:start + T].assign(v).realize()
        keys = self.cache_k[:, 0:start + T].transpose(1, 2)  # (B, H, start+T, hd)
        values = self.cache_v[:, 0:start + T].transpose(1, 2)
        scores = q.transpose(1, 2) @ keys.transpose(2, 3) / math.sqrt(self.head_dim)  # (B, H, T, start+T)
        if T > 1:  # a prompt: each query sees the rows up to its own position
            rows, queries = Tensor.arange(start + T).reshape(1, 1, 1, -1), Tensor.arange(start, start + T)
            scores = (rows <= queries.reshape(1, 1, T, 1)).where(scores, -math.inf)
        return self.c_proj((scores.softmax(-1) @ values).transpose(1, 2).reshape(B, T, dim))

class MLP:
    def __init__(self, cfg: Config):
        self.c_fc, self.c_proj = nn.Linear(cfg.dim, 4 * cfg.dim), nn.Linear(4 * cfg.dim, cfg.dim)
    def __call__(self, x: Tensor) -> Tensor: return self.c_proj(self.c_fc(x).gelu())

class Block:
    def __init__(self, cfg: Config, batch: int):
        self.ln_1, self.attn = nn.LayerNorm(cfg.dim, cfg.norm_eps), Attention(cfg, batch)
        self.ln_2, self.mlp = nn.LayerNorm(cfg.dim, cfg.norm_eps), MLP(cfg)
    def __call__(self, x: Tensor, start: int | UOp | None) -> Tensor:
        x = x + self.attn(self.ln_1(x), start)
        return x + self.mlp(self.ln_2(x))

class GPT2:
    """GPT-2 with Hugging Face's parameter names (wte, wpe, h.N.*, ln_f); the LM head is tied to wte."""
    def __init__(self, cfg: Config = Config(), batch: int = 1):
        self.cfg = cfg
        self.wte, self.wpe = nn.Embedding(cfg.vocab_size, cfg.dim), nn.Embedding(cfg.max_context, cfg.dim)
        self.h = [Block(cfg, batch) for _ in range(cfg.n_layer)]
        self.ln_f = nn.LayerNorm(cfg.dim, cfg.norm_eps)
        self._decode = TinyJit(self.forward)
        self.start_pos = Variable("start_pos", 0, cfg.max_context - 1)

    def forward(self, tokens: Tensor, start: int | UOp | None) -> Tensor:
        """Logits (B, T, vocab) for tokens (B, T) at positions start.. (start: an int, or a bound Variable); start
        None: positions 0.. without the KV cache, which training uses."""
        T, first = tokens.shape[1], 0 if start is None else start
        x = self.wte(tokens) + self.wpe(Tensor.arange(T, dtype=dtypes.int32).reshape(1, T) + first)
        for block in self.h: x = block(x, start)
        return self.ln_f(x) @ self.wte.weight.T

    def __call__(self, tokens: Tensor, start: int) -> Tensor:
        """Logits for tokens at position `start`; single tokens go through the TinyJit-compiled step."""
        if start + tokens.shape[1] > self.cfg.max_context:
            raise ValueError(f"positions {start}..{start + tokens.shape[1] - 1} are past the context "
                             f"({self.cfg.max_context})")
        if tokens.shape[1] == 1: return self._decode(tokens.cast(dtypes.int32).contiguous(), self.start_pos.bind(start))
        return self.forward(tokens.cast(dtypes.int32), start)

    def parameters(self) -> list[Tensor]:
        """The trainable tensors (the state dict without the KV caches)."""
        return [v for k, v in get_state_dict(self).items() if "cache" not in k]

    def loss(self, tokens: Tensor) -> Tensor:
        """Mean cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1] (B, T+1 tokens), without the cache."""
        if tokens.ndim != 2 or tokens.shape[1] < 2 or tokens.shape[1] - 1 > self.cfg.max_context:
            raise ValueError(f"loss needs (batch, 2..{self.cfg.max_context + 1}) tokens, got shape {tokens.shape}")
        tokens = tokens.cast(dtypes.int32)
        return self.forward(tokens[:, :-1], None).sparse_categorical_crossentropy(tokens[:, 1:])

    def load_hf(self, fn: str) -> None:
        """Load a Hugging Face GPT-2 .safetensors file (its Conv1D weights are the transposes of Linear's)."""
        sd = {k.removeprefix("transformer."): v for k, v in safe_load(fn).items()}
        for k in list(sd):
            if k.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")): sd[k] = sd[k].T
        wanted = get_state_dict(self)
        load_state_dict(self, {k: v for k, v in sd.items() if k in wanted}, strict=False)

def sample(logits: Tensor, temperature: float = 0.8, top_k: int = 40, rng: random.Random | None = None) -> int:
    """A token drawn from the top_k logits at this temperature (greedy when temperature is 0). The choice among the
    top k runs on the host: it is a few dozen numbers, and sorting the vocabulary on the device each step costs more
    than the whole forward pass."""
    vals = logits.tolist()
    if temperature == 0: return max(range(len(vals)), key=vals.__getitem__)
    top = heapq.nlargest(top_k, range(len(vals)), key=vals.__getitem__)
    m = vals[top[0]]
    weights = [math.exp((vals[i] - m) / temperature) for i in top]
    return (rng or random).choices(top, weights)[0]

def generate(model: GPT2, prompt: list[int], count: int, temperature: float = 0.8, top_k: int = 40,
             quiet: bool = False) -> tuple[list[int], float]:
    """prompt + count sampled tokens, and the decoding speed in tokens per second (after the two warm-up tokens)."""
    toks = list(prompt)
    logits = model(Tensor([toks], dtype=dtypes.int32), 0)[0, -1]
    times = []
    for _ in range(count):
        st = time.perf_counter()
        toks.append(sample(logits, temperature, top_k))
        if len(toks) >= model.cfg.max_context: break
        logits = model(Tensor([[toks[-1]]], dtype=dtypes.int32), len(toks) - 1)[0, -1]
        times.append(time.perf_counter() - st)
        if not quiet: print(toks[-1], end=" ", flush=True)
    if not quiet: print()
    steady = times[2:] or times
    return toks, len(steady) / sum(steady) if steady else 0.0

def main() -> None:
    ap = argparse.ArgumentParser(description="GPT-2 text generation with a KV cache under TinyJit")
    ap.add_argument("--weights", help="a Hugging Face GPT-2 model.safetensors")
    ap.add_argument("--random", action="store_true", help="random weights of the 124M shape (a speed run)")
    ap.add_argument("--prompt", default="The meaning of life is")
    ap.add_argument("--count", type=int, default=20)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top_k", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not args.weights and not args.random: ap.error("give --weights PATH or --random")
    Tensor.manual_seed(args.seed)
    model = GPT2()
    if args.weights: model.load_hf(args.weights)
    enc = None
    try:
        import tiktoken
        enc = tiktoken.get_encoding("gpt2")
    except Exception as e:  # not installed, or its vocabulary can't be fetched here
        print(f"(no tiktoken encoding: {type(e).__name__}; prompt and output are token ids)")
    prompt = enc.encode(args.prompt) if enc else [464, 3616, 286, 1204, 318]
    toks, tps = generate(model, prompt, args.count, args.temperature, args.top_k, quiet=enc is not None)
    print(enc.decode(toks) if enc else toks)
    print(f"{tps:.2f} tokens/s")

if __name__ == "__main__":
    main()
