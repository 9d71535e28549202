"""EAGLE-3: the target's aux hidden states against transformers, and the draft head over Ember's paged KV
cache against a plain float32 PyTorch reference, on random checkpoints in SpecForge's and vLLM's layouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import make_checkpoint
from safetensors.torch import save_file

from ember.config import LoadConfig
from ember.errors import ModelLoadError
from ember.model.eagle3 import default_aux_layers, load_eagle3
from ember.model.hf_config import ModelConfig
from ember.model.llama import CausalLM
from ember.model.loader import load_model_files
from ember.ops.attention import AttentionMetadata
from ember.runner.kv_cache import KVCache

BLOCK_SIZE = 4
BLOCKS = [5, 2, 7, 0]  # the sequence's block table: out of order, so a wrong slot shows


def _meta(start: int, n: int) -> AttentionMetadata:
    """One sequence computing positions start .. start + n - 1 (a decode when n == 1)."""
    table = torch.tensor([BLOCKS], dtype=torch.int32)
    pos = torch.arange(start, start + n)
    end = start + n
    return AttentionMetadata(
        slot_mapping=table[0, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE,
        block_tables=table,
        seq_lens=torch.tensor([end], dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        num_decodes=int(n == 1),
        max_query_len=0 if n == 1 else n,
        max_seq_len=end,
        seq_lens_host=[end],
        query_start_host=[0, n],
    )


def _kv(layers, cfg: ModelConfig) -> None:
    KVCache(layers, cfg.num_key_value_heads, cfg.head_dim, BLOCK_SIZE, torch.float32, torch.device("cpu")).allocate(8)


# --- the target's aux hidden states -------------------------------------------------------------


def test_aux_hidden_states_match_transformers(tmp_path):
    import transformers

    path = make_checkpoint(tmp_path / "llama", "llama", num_hidden_layers=8)
    files = load_model_files(LoadConfig(model=str(path), tokenizer=None, load_format="auto", quantization=None))
    cfg = files.model_config
    assert files.weights is not None
    model = CausalLM(cfg, 64)
    with torch.no_grad():
        model.load_weights(files.weights(), str(path))
    _kv(model.attention_layers(), cfg)
    layers = default_aux_layers(cfg.num_hidden_layers)
    assert layers == (2, 4, 5)
    model.set_aux_hidden_state_layers((0, *layers))
    with pytest.raises(ValueError, match="distinct layer ids"):
        model.set_aux_hidden_state_layers((2, 2, 8))

    ids = torch.randint(3, cfg.vocab_size, (10,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        model(ids[:9], torch.arange(9), _meta(0, 9))  # prefill
        prefill = model.aux_hidden_states
        model(ids[9:], torch.arange(9, 10), _meta(9, 1))  # a decode step
        decode = model.aux_hidden_states
    hf = transformers.LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    with torch.no_grad():
        states = hf(ids[None], output_hidden_states=True).hidden_states  # [i]: the input of layer i
    expected = torch.cat([states[i][0] for i in (0, *layers)], dim=-1)
    assert prefill is not None and decode is not None
    assert prefill.shape == (9, 4 * cfg.hidden_size)
    torch.testing.assert_close(prefill, expected[:9], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(decode, expected[9:], atol=1e-4, rtol=1e-4)


# --- the draft head -----------------------------------------------------------------------------

TARGET = ModelConfig.from_hf_config(
    {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 512,
        "hidden_size": 48,
        "intermediate_size": 96,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
    }
)
H, HEADS, KV_HEADS, D, INTER, DRAFT_VOCAB, EPS, THETA = 64, 4, 2, 16, 128, 64, 1e-5, 10000.0


def _draft_weights(seed: int) -> dict[str, torch.Tensor]:
    """A random draft in SpecForge's names, with a target embedding; d2t maps the draft vocabulary onto a
    scattered subset of the target's."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm() -> torch.Tensor:
        return 0.5 + torch.rand(H, generator=g)

    target_ids = torch.randperm(TARGET.vocab_size, generator=g)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(TARGET.vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    return {
        "embed_tokens.weight": rand(TARGET.vocab_size, H, std=1.0),
        "fc.weight": rand(H, 3 * TARGET.hidden_size),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": rand(HEADS * D, 2 * H),
        "midlayer.self_attn.k_proj.weight": rand(KV_HEADS * D, 2 * H),
        "midlayer.self_attn.v_proj.weight": rand(KV_HEADS * D, 2 * H),
        "midlayer.self_attn.o_proj.weight": rand(H, HEADS * D),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.mlp.gate_proj.weight": rand(INTER, H),
        "midlayer.mlp.up_proj.weight": rand(INTER, H),
        "midlayer.mlp.down_proj.weight": rand(H, INTER),
        "norm.weight": norm(),
        "lm_head.weight": rand(DRAFT_VOCAB, H, std=0.5),
        "d2t": target_ids - torch.arange(DRAFT_VOCAB),
        "t2d": t2d,
    }


def _write_draft(path: Path, tensors: dict[str, torch.Tensor], **config) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": H,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "intermediate_size": INTER,
        "num_hidden_layers": 1,
        "rms_norm_eps": EPS,
        "rope_theta": THETA,
        "max_position_embeddings": 256,
        "vocab_size": TARGET.vocab_size,
        "draft_vocab_size": DRAFT_VOCAB,
        "target_hidden_size": TARGET.hidden_size,
        **config,
    }
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def _rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Neox rotary over whole heads; x [T, heads, D]."""
    inv_freq = 1.0 / THETA ** (torch.arange(0, D, 2).float() / D)
    angles = torch.cat([pos[:, None].float() * inv_freq] * 2, dim=-1)[:, None]
    rotated = torch.cat([-x[..., D // 2 :], x[..., : D // 2]], dim=-1)
    return x * angles.cos() + rotated * angles.sin()


def _reference(w: dict[str, torch.Tensor], ids: torch.Tensor, hidden: torch.Tensor, norm_before_residual: bool):
    """The draft over a whole sequence with full causal attention: (h_normed, h_prenorm, logits over the
    target vocabulary) for every row. `hidden` [T, H]: fc already applied where the target's states came."""
    lw = {k.removeprefix("midlayer."): v for k, v in w.items()}
    normed = _rms(hidden, lw["hidden_norm.weight"])
    x = torch.cat([_rms(w["embed_tokens.weight"][ids], lw["input_layernorm.weight"]), normed], dim=-1)
    pos = torch.arange(len(ids))
    q = _rope((x @ lw["self_attn.q_proj.weight"].T).view(-1, HEADS, D), pos)
    k = _rope((x @ lw["self_attn.k_proj.weight"].T).view(-1, KV_HEADS, D), pos)
    v = (x @ lw["self_attn.v_proj.weight"].T).view(-1, KV_HEADS, D)
    group = HEADS // KV_HEADS
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * D**-0.5
    scores = scores.masked_fill(torch.ones(len(ids), len(ids), dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(len(ids), HEADS * D)
    residual = (attn @ lw["self_attn.o_proj.weight"].T) + (normed if norm_before_residual else hidden)
    y = _rms(residual, lw["post_attention_layernorm.weight"])
    mlp = (F.silu(y @ lw["mlp.gate_proj.weight"].T) * (y @ lw["mlp.up_proj.weight"].T)) @ lw["mlp.down_proj.weight"].T
    prenorm = mlp + residual
    h_normed = _rms(prenorm, w["norm.weight"])
    logits = torch.full((len(ids), TARGET.vocab_size), float("-inf"))
    logits[:, w["d2t"] + torch.arange(DRAFT_VOCAB)] = h_normed @ w["lm_head.weight"].T
    return h_normed, prenorm, logits


@pytest.mark.parametrize("layout", ["specforge", "vllm"])
@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_draft_matches_reference(tmp_path, layout, norm_before_residual):
    w = _draft_weights(seed=3)
    target_embedding = torch.nn.Embedding.from_pretrained(w["embed_tokens.weight"])
    if layout == "specforge":  # the target's embedding is shared
        stored = {k: v for k, v in w.items() if k != "embed_tokens.weight"}
    else:  # vLLM's names, the draft's own embedding
        stored = {
            ("model." + k.replace("midlayer.", "layers.0.") if k != "lm_head.weight" else k): v for k, v in w.items()
        }
    path = _write_draft(tmp_path / "draft", stored, norm_before_residual=norm_before_residual)
    draft = load_eagle3(str(path), TARGET, torch.device("cpu"), torch.float32)
    assert draft.aux_hidden_state_layers == (2, 4, 5)
    draft.share_embedding(target_embedding)
    assert (draft.embed_tokens is target_embedding) == (layout == "specforge")
    _kv(draft.attention_layers(), draft.config.model)

    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, TARGET.vocab_size, (12,), generator=g)
    aux = torch.randn(10, 3 * TARGET.hidden_size, generator=g)
    ref_hidden = aux @ w["fc.weight"].T  # rows fed back by the decode steps are appended below
    steps = [(0, 10, aux)]  # (start, count, hidden_states passed to the draft)
    with torch.inference_mode():
        for step in range(3):
            start, n, hidden = steps[step]
            h_normed, h_prenorm = draft(ids[start : start + n], torch.arange(start, start + n), hidden, _meta(start, n))
            logits, tokens = draft.compute_logits(h_normed), draft.draft_tokens(h_normed)
            ref_normed, ref_prenorm, ref_logits = _reference(w, ids[: start + n], ref_hidden, norm_before_residual)
            rows = slice(start, start + n)
            torch.testing.assert_close(h_normed, ref_normed[rows], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(h_prenorm, ref_prenorm[rows], atol=1e-4, rtol=1e-4)
            finite = ref_logits[rows].isfinite()
            assert logits.dtype == torch.float32 and torch.equal(logits.isfinite(), finite)
            assert int(finite.sum(-1)[0]) == DRAFT_VOCAB
            torch.testing.assert_close(logits[finite], ref_logits[rows][finite], atol=1e-4, rtol=1e-4)
            assert torch.equal(tokens, ref_logits[rows].argmax(-1))
            # the next step decodes one token from the draft's own last pre-norm state
            steps.append((start + n, 1, h_prenorm[-1:]))
            ref_hidden = torch.cat([ref_hidden, ref_prenorm[start + n - 1 :][:1]])


def test_missing_weight_is_named(tmp_path):
    w = {k: v for k, v in _draft_weights(seed=5).items() if k not in ("fc.weight", "embed_tokens.weight")}
    path = _write_draft(tmp_path / "draft", w)
    with pytest.raises(ModelLoadError, match="'fc.weight'"):
        load_eagle3(str(path), TARGET, torch.device("cpu"), torch.float32)


def test_refuses_a_draft_of_another_model(tmp_path):
    path = _write_draft(tmp_path / "draft", _draft_weights(seed=6), target_hidden_size=32)
    with pytest.raises(ModelLoadError, match="target_hidden_size 32"):
        load_eagle3(str(path), TARGET, torch.device("cpu"), torch.float32)
