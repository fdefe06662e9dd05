"""The GPT-2 example against a reference written here with PyTorch (no cache: the whole sequence recomputed each
step), with the same random weights: logits for a prompt and for several cached decoding steps under TinyJit."""
from __future__ import annotations
import math
import os
import pathlib
import sys
import numpy as np
import torch
import torch.nn.functional as F
import pytest
from fusegrad import Tensor, nn
from fusegrad.engine.realize import method_cache
from fusegrad.nn.state import get_state_dict

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import gpt2  # noqa: E402
sys.path.pop(0)

torch.set_num_threads(1)

def torch_gpt2(sd: dict[str, torch.Tensor], cfg: gpt2.Config, tokens: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, vocab) of the plain GPT-2 forward (Linear weights as (out, in))."""
    B, T = tokens.shape
    x = sd["wte.weight"][tokens] + sd["wpe.weight"][torch.arange(T)]
    hd = cfg.dim // cfg.n_head
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(cfg.n_layer):
        p = lambda n: sd[f"h.{i}.{n}"]  # noqa: E731
        h = F.layer_norm(x, (cfg.dim,), p("ln_1.weight"), p("ln_1.bias"), cfg.norm_eps)
        q, k, v = F.linear(h, p("attn.c_attn.weight"), p("attn.c_attn.bias")).split(cfg.dim, dim=-1)
        q, k, v = (t.reshape(B, T, cfg.n_head, hd).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(~mask, -math.inf).softmax(-1)
        x = x + F.linear((att @ v).transpose(1, 2).reshape(B, T, cfg.dim), p("attn.c_proj.weight"),
                         p("attn.c_proj.bias"))
        h = F.layer_norm(x, (cfg.dim,), p("ln_2.weight"), p("ln_2.bias"), cfg.norm_eps)
        h = F.gelu(F.linear(h, p("mlp.c_fc.weight"), p("mlp.c_fc.bias")), approximate="tanh")
        x = x + F.linear(h, p("mlp.c_proj.weight"), p("mlp.c_proj.bias"))
    x = F.layer_norm(x, (cfg.dim,), sd["ln_f.weight"], sd["ln_f.bias"], cfg.norm_eps)
    return x @ sd["wte.weight"].T

def test_logits_match_torch_for_prompt_and_cached_steps():
    cfg = gpt2.Config(n_layer=2, n_head=2, dim=32, vocab_size=97, max_context=32)
    Tensor.manual_seed(3)
    model = gpt2.GPT2(cfg)
    sd = {k: torch.tensor(v.numpy()) for k, v in get_state_dict(model).items() if "cache" not in k}
    toks = [5, 17, 3, 90, 41]
    got = model(Tensor([toks]), 0).numpy()
    ref = torch_gpt2(sd, cfg, torch.tensor([toks])).numpy()
    np.testing.assert_allclose(got, ref, atol=2e-4, rtol=1e-3)
    for step in range(5):  # cached single-token steps: the JIT warms up, captures, then replays
        toks.append(int(got[0, -1].argmax()))
        compiled = len(method_cache)
        got = model(Tensor([[toks[-1]]]), len(toks) - 1).numpy()
        # the position is a symbolic size: later positions run the same kernels
        if step >= 1: assert len(method_cache) == compiled, f"decoding step {step} compiled new kernels"
        ref = torch_gpt2(sd, cfg, torch.tensor([toks])).numpy()[:, -1:]
        np.testing.assert_allclose(got, ref, atol=2e-4, rtol=1e-3, err_msg=f"decoding step {step}")
    assert os.getenv("JIT") == "0" or len(model._decode.captured) > 0

def test_generate_samples_valid_tokens():
    cfg = gpt2.Config(n_layer=1, n_head=2, dim=16, vocab_size=50, max_context=16)
    model = gpt2.GPT2(cfg)
    toks, tps = gpt2.generate(model, [1, 2, 3], 6, temperature=0.8, top_k=5, quiet=True)
    assert len(toks) == 9 and all(0 <= t < 50 for t in toks) and tps > 0
    greedy = gpt2.generate(gpt2.GPT2(cfg), [1, 2, 3], 3, temperature=0, quiet=True)[0]
    assert len(greedy) == 6

def test_training_loss_gradients_and_adamw_step_match_torch():
    cfg = gpt2.Config(n_layer=2, n_head=2, dim=32, vocab_size=97, max_context=16)
    Tensor.manual_seed(5)
    model = gpt2.GPT2(cfg)
    sd = {k: torch.tensor(v.numpy()).requires_grad_() for k, v in get_state_dict(model).items() if "cache" not in k}
    assert len(model.parameters()) == len(sd)
    toks = np.random.default_rng(1).integers(0, cfg.vocab_size, (3, 9))
    params = model.parameters()
    opt = nn.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    topt = torch.optim.AdamW(list(sd.values()), lr=1e-2, weight_decay=0.1)
    def torch_loss():
        logits = torch_gpt2(sd, cfg, torch.tensor(toks[:, :-1]))
        return F.cross_entropy(logits.reshape(-1, cfg.vocab_size), torch.tensor(toks[:, 1:]).reshape(-1))
    with Tensor.train():
        for step in range(2):
            opt.zero_grad()
            topt.zero_grad()
            loss = model.loss(Tensor(toks.astype(np.int32)))
            loss.backward()
            tloss = torch_loss()
            tloss.backward()
            np.testing.assert_allclose(loss.item(), tloss.item(), rtol=1e-5, err_msg=f"loss at step {step}")
            # the tied embedding gets gradients from the lookup and from the LM head; wpe only for positions 0..7
            for name in ("wte.weight", "wpe.weight", "h.0.attn.c_attn.weight", "h.1.mlp.c_fc.bias", "ln_f.weight"):
                g, tg = dict(zip(sd, params))[name].grad.numpy(), sd[name].grad.numpy()
                np.testing.assert_allclose(g, tg, atol=1e-5 * np.abs(tg).max(), rtol=1e-3, err_msg=name)
            opt.step()
            topt.step()
    for (name, tp), p in zip(sd.items(), params):
        got, want = p.numpy(), tp.detach().numpy()
        if name.endswith("c_attn.bias"):
            # the key bias adds the same q.b to every score of a row, which softmax cancels: its exact gradient is 0,
            # the computed one rounding noise, which Adam scales up to steps of lr with either sign
            keep = np.r_[0:cfg.dim, 2 * cfg.dim:3 * cfg.dim]
            got, want = got[keep], want[keep]
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4, err_msg=name)

def test_training_loss_refuses_bad_token_shapes():
    model = gpt2.GPT2(gpt2.Config(n_layer=1, n_head=2, dim=16, vocab_size=50, max_context=8))
    with pytest.raises(ValueError, match="loss needs"): model.loss(Tensor([[1, 2, 3]]).reshape(3))
    with pytest.raises(ValueError, match="loss needs"): model.loss(Tensor([[1] * 10]))
