"""Write the HF golden fixtures under tests/fixtures/ (run by scripts/make_fixtures.sh).

Runs in a separate Python 3.11 venv with torch + transformers; imports nothing
from jaxserve, so every number here comes from an independent implementation
(HF transformers' LlamaForCausalLM, float32, eager attention, CPU).

Writes:
  tiny_<variant>/   HF dir (config.json, model.safetensors or shards + index,
                    tokenizer.json, tokenizer_config.json) and logits.npz
                    (ids_<j> i32[T], logits_<j> f32[T, V]) for a few sequences.
  tiny_gguf/        the same kind of model as GGUF (F32 and Q8_0, Q/K rows
                    permuted as llama.cpp's convert_hf_to_gguf does) with
                    logits_<type>.npz computed by transformers from the GGUF.
  tiny_<family>/    Qwen2 (q/k/v biases), Qwen3 (per-head q/k RMSNorm) and Mistral
                    checkpoints from their own transformers classes: HF dir,
                    logits.npz as above, and greedy.json (16 greedy tokens
                    from two prompts, with the top-2 logit gap of each step).
  tiny_qwen2_gguf/  the tiny Qwen2 as a GGUF with general.architecture "qwen2" (F32,
                    biases as attn_{q,k,v}.bias, Q/K rows NOT permuted, as llama.cpp's
                    Qwen2Model converter writes them) and logits_f32.npz computed by
                    transformers from that GGUF.
  smollm2/          tokenizer_golden.json and greedy_golden.json for the real
                    SmolLM2-135M-Instruct Q4_1 GGUF, loaded by transformers
                    (gguf_file=..., which dequantizes to float32); greedy32_golden.json
                    (issue 26): the 32 prompts of smollm2/greedy32_prompts.txt, chat-templated,
                    16 greedy tokens each with the chosen token's logprob and the top-2 gap.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
          " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")

# Tiny configs with mutually distinct sizes, so a transposed axis fails loudly.
VARIANTS = {
    "untied": dict(vocab_size=67, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                   num_attention_heads=6, num_key_value_heads=2, head_dim=12,
                   tie_word_embeddings=False, rope_theta=10000.0),
    "tied_sharded": dict(vocab_size=71, hidden_size=40, intermediate_size=56, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=10,
                         tie_word_embeddings=True, rope_theta=50000.0),
    "llama3_rope": dict(vocab_size=67, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                        num_attention_heads=6, num_key_value_heads=3, head_dim=16,
                        tie_word_embeddings=False, rope_theta=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
}
# GGUF variant: every matrix row length (E=64, H*D=96, F=160) is a multiple of
# the Q8_0 block (32), as llama.cpp requires to quantize a tensor.
GGUF_VARIANT = dict(vocab_size=67, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                    tie_word_embeddings=False, rope_theta=10000.0)
SEQ_LENS = (5, 9, 13)
# Other families, each through its own transformers class. Qwen2 keeps hidden = H * D (its
# attention derives head_dim from them) and carries `sliding_window` with
# use_sliding_window=False, as every published Qwen2 config does; Qwen3 and Mistral take an
# explicit head_dim that differs from hidden / H, so a wrong derivation fails.
FAMILIES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM,
              dict(vocab_size=73, hidden_size=56, intermediate_size=88, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                   rope_theta=1000000.0, use_sliding_window=False, sliding_window=32,
                   max_window_layers=2, rms_norm_eps=1e-6)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM,
              dict(vocab_size=77, hidden_size=44, intermediate_size=72, num_hidden_layers=2,
                   num_attention_heads=6, num_key_value_heads=3, head_dim=16,
                   tie_word_embeddings=True, rope_theta=1000000.0, attention_bias=False,
                   use_sliding_window=False, sliding_window=None, rms_norm_eps=1e-6)),
    "mistral": (MistralConfig, MistralForCausalLM,
                dict(vocab_size=61, hidden_size=40, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=1, head_dim=12,
                     tie_word_embeddings=False, rope_theta=10000.0, sliding_window=None,
                     rms_norm_eps=1e-5)),
}
GREEDY_PROMPTS = ("the cat sat on", "hello world, this is")


# ---------------------------------------------------------------------------------------------
# tiny byte-level BPE vocabulary (specials + characters + merges), exactly n tokens
# ---------------------------------------------------------------------------------------------

def tiny_vocab(n: int) -> tuple[list[str], list[str]]:
    chars = list("abcdefghijklmnopqrstuvwxyz") + ["Ġ", "Ċ"] + list("0123456789") + list(".,!?")
    tokens = SPECIALS + chars
    merges = []
    for a, b in [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"),
                 ("Ġ", "s"), ("r", "e"), ("a", "t"), ("e", "n"), ("Ġ", "w"), ("o", "r"), ("i", "s"),
                 ("Ġ", "c"), ("Ġ", "h"), ("e", "d"), ("a", "n"), ("Ġ", "b"), ("Ġ", "i"), ("Ġ", "o"),
                 ("e", "s"), ("Ġ", "m"), ("a", "r"), ("a", "l"), ("l", "e"), ("i", "t"), ("Ġ", "f"),
                 ("Ġ", "p"), ("Ġ", "d"), ("o", "u"), ("in", "g"), ("l", "l")]:
        if len(tokens) >= n:
            break
        tokens.append(a + b)
        merges.append(f"{a} {b}")
    assert len(tokens) == n, (len(tokens), n)
    return tokens, merges


def tiny_tokenizer(n: int) -> Tokenizer:
    tokens, merges = tiny_vocab(n)
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)},
                               [tuple(m.split(" ")) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok


# ---------------------------------------------------------------------------------------------
# tiny HF models
# ---------------------------------------------------------------------------------------------

def tiny_model(kw: dict, seed: int, config_cls=LlamaConfig, model_cls=LlamaForCausalLM):
    kw = {"rms_norm_eps": 1e-5, **kw}
    cfg = config_cls(max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                     attn_implementation="eager", **kw)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # not all-ones: a swapped norm must show
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return model


def logits_for(model, vocab: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for j, T in enumerate(SEQ_LENS):
        ids = rng.integers(0, vocab, size=T).astype(np.int32)
        with torch.no_grad():
            logits = model(torch.from_numpy(ids.astype(np.int64))[None]).logits[0]
        out[f"ids_{j}"] = ids
        out[f"logits_{j}"] = logits.float().numpy()
    return out


def write_tiny_hf(out: Path) -> None:
    for k, (name, kw) in enumerate(VARIANTS.items()):
        d = out / f"tiny_{name}"
        shutil.rmtree(d, ignore_errors=True)
        model = tiny_model(kw, seed=100 + k)
        shard = "40KB" if "sharded" in name else "50MB"
        model.save_pretrained(d, safe_serialization=True, max_shard_size=shard)
        tiny_tokenizer(kw["vocab_size"]).save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHATML}, indent=1))
        np.savez(d / "logits.npz", **logits_for(model, kw["vocab_size"], seed=7 + k))
        print(f"wrote {d}: {sorted(p.name for p in d.iterdir())}")


def greedy_for(model, tok: Tokenizer, steps: int = 16) -> list[dict]:
    runs = []
    for text in GREEDY_PROMPTS:
        ids = tok.encode(text).ids
        seq = torch.tensor([ids])
        new, gaps = [], []
        with torch.no_grad():
            for _ in range(steps):  # plain full forwards: no cache, nothing to disagree about
                last = model(seq).logits[0, -1].float()
                top2 = torch.topk(last, 2).values
                gaps.append(float(top2[0] - top2[1]))
                nxt = int(torch.argmax(last))
                new.append(nxt)
                seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
        runs.append({"prompt": text, "prompt_ids": ids, "greedy_ids": new, "top2_logit_gap": gaps})
    return runs


def write_tiny_families(out: Path) -> None:
    for k, (name, (config_cls, model_cls, kw)) in enumerate(FAMILIES.items()):
        d = out / f"tiny_{name}"
        shutil.rmtree(d, ignore_errors=True)
        model = tiny_model(kw, seed=300 + k, config_cls=config_cls, model_cls=model_cls)
        model.save_pretrained(d, safe_serialization=True)
        tok = tiny_tokenizer(kw["vocab_size"])
        tok.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHATML}, indent=1))
        np.savez(d / "logits.npz", **logits_for(model, kw["vocab_size"], seed=17 + k))
        (d / "greedy.json").write_text(json.dumps(
            {"source": f"transformers {__import__('transformers').__version__} {model_cls.__name__}"
                       ", float32, eager attention, greedy by full forwards",
             "runs": greedy_for(model, tok)}, indent=1))
        print(f"wrote {d}: {sorted(p.name for p in d.iterdir())}")
        if name == "qwen2":
            write_qwen2_gguf(out / "tiny_qwen2_gguf", model, kw["vocab_size"])


def write_qwen2_gguf(d: Path, model, vocab: int) -> None:
    """The tiny Qwen2 as an F32 "qwen2" GGUF, checked by transformers' own GGUF loader."""
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    fname = "tiny-qwen2-f32.gguf"
    write_gguf(model, d / fname, gguf.GGMLQuantizationType.F32, arch="qwen2", pre="qwen2")
    ref = AutoModelForCausalLM.from_pretrained(str(d), gguf_file=fname, dtype=torch.float32,
                                               attn_implementation="eager").eval()
    assert type(ref).__name__ == "Qwen2ForCausalLM", type(ref).__name__
    logits = logits_for(ref, vocab, seed=23)
    src = logits_for(model, vocab, seed=23)
    err = max(np.abs(src[k] - logits[k]).max() for k in src if k.startswith("logits"))
    assert err < 1e-4, f"transformers' qwen2 GGUF load differs from the source model by {err}"
    np.savez(d / "logits_f32.npz", **logits)
    (d / "README.json").write_text(json.dumps(
        {"config": FAMILIES["qwen2"][2], "source_max_abs_diff": float(err),
         "reference": "transformers AutoModelForCausalLM.from_pretrained(gguf_file=...)"}, indent=1))
    print(f"wrote {d}: {sorted(p.name for p in d.iterdir())}")


# ---------------------------------------------------------------------------------------------
# tiny GGUF (F32 and Q8_0)
# ---------------------------------------------------------------------------------------------

def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF rotate_half rows -> GGML pair rows."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, i, *rest, kind = hf.split(".")  # kind: "weight" | "bias" (Qwen2's q/k/v)
    sub = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
           "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
           "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down"}[".".join(rest)]
    return f"blk.{i}.{sub}.{kind}"


def write_gguf(model, path: Path, qtype: gguf.GGMLQuantizationType, arch: str = "llama",
               pre: str = "gpt2") -> None:
    """Write `model` as llama.cpp's converter would: only arch "llama" permutes Q/K rows."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("jaxserve-tiny")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(c.rope_theta if hasattr(c, "rope_theta") else c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == gguf.GGMLQuantizationType.Q8_0
                    else gguf.LlamaFileType.ALL_F32)
    tokens, merges = tiny_vocab(c.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHATML)
    for name, p in model.state_dict().items():
        a = p.float().numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            a = llama_cpp_permute(a, c.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            a = llama_cpp_permute(a, c.num_key_value_heads)
        if a.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            q = gguf.quants.quantize(a, qtype)
            w.add_tensor(gguf_name(name), q, raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_tiny_gguf(out: Path) -> None:
    d = out / "tiny_gguf"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    model = tiny_model(GGUF_VARIANT, seed=200)
    how = {}
    for qname in ("F32", "Q8_0"):
        qtype = gguf.GGMLQuantizationType[qname]
        fname = f"tiny-{qname.lower()}.gguf"
        write_gguf(model, d / fname, qtype)
        # The reference: transformers' own GGUF loader (it dequantizes and un-permutes).
        ref = AutoModelForCausalLM.from_pretrained(str(d), gguf_file=fname, dtype=torch.float32,
                                                   attn_implementation="eager").eval()
        how[qname] = "transformers AutoModelForCausalLM.from_pretrained(gguf_file=...)"
        logits = logits_for(ref, GGUF_VARIANT["vocab_size"], seed=11)
        if qname == "F32":  # sanity: the GGUF round trip reproduces the source model
            src = logits_for(model, GGUF_VARIANT["vocab_size"], seed=11)
            err = max(np.abs(src[k] - logits[k]).max() for k in src if k.startswith("logits"))
            assert err < 1e-4, f"transformers' F32 GGUF load differs from the source model by {err}"
        np.savez(d / f"logits_{qname.lower()}.npz", **logits)
    (d / "README.json").write_text(json.dumps({"config": GGUF_VARIANT, "reference": how}, indent=1))
    print(f"wrote {d}: {sorted(p.name for p in d.iterdir())}")


# ---------------------------------------------------------------------------------------------
# real model: SmolLM2-135M-Instruct Q4_1
# ---------------------------------------------------------------------------------------------

PLAIN = [
    "Hello, world! The year 2024 had 366 days; pi is 3.14159.",
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x**2  # square\n",
    "日本語のテキストと中文字符",
    "Emoji: 😀🚀👍🏽 and accents: café, naïve, über, São Paulo, Ångström",
    "   leading spaces,\ttabs\t\tand\n\n\nnewlines   trailing   ",
    "<|im_start|>user\nliteral special tokens<|im_end|>",
    "",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three primary colors."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Translate 'good morning' to Japanese: おはよう? 🙂"}],
]


def smollm2_tokenizer(model_dir: str, fname: str):
    tok = AutoTokenizer.from_pretrained(model_dir, gguf_file=fname)
    # transformers' GGUF tokenizer builder has no split rule for tokenizer.ggml.pre="smollm" and
    # falls back to plain GPT-2 byte-level splitting. SmolLM2's published tokenizer.json (and
    # llama.cpp's SMOLLM pre-tokenizer) first isolate each digit, then apply the GPT-2 regex;
    # restore that so the golden ids are the model's real ids.
    raw = AutoTokenizer.from_pretrained(model_dir, gguf_file=fname)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return tok, raw


def write_smollm2(out: Path, model_path: Path) -> None:
    d = out / "smollm2"
    d.mkdir(parents=True, exist_ok=True)
    model_dir, fname = str(model_path.parent), model_path.name
    tok, raw = smollm2_tokenizer(model_dir, fname)
    plain = []
    for s in PLAIN:
        ids = tok.encode(s, add_special_tokens=False)
        plain.append({"text": s, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False),
                      "same_as_transformers_gguf_pretokenizer":
                          ids == raw.encode(s, add_special_tokens=False)})
    chats = []
    for msgs in CHATS:
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        chats.append({"messages": msgs, "text": text, "ids": ids})
    (d / "tokenizer_golden.json").write_text(json.dumps(
        {"source": f"transformers {__import__('transformers').__version__} AutoTokenizer(gguf_file=...)"
                   " with SmolLM2's Digits+ByteLevel pre-tokenizer",
         "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
         "vocab_size": len(tok), "plain": plain, "chat": chats}, indent=1, ensure_ascii=False))

    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=fname, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    runs = []
    for c in chats:
        ids = torch.tensor([c["ids"]])
        with torch.no_grad():
            # An explicit all-ones mask: without it generate() infers one from pad_token_id
            # (<|im_end|> here) and would hide the prompt's own <|im_end|> tokens.
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                                 do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=tok.eos_token_id,
                                 eos_token_id=None)
            first = model(ids).logits[0, -1]
        new = gen.sequences[0, ids.shape[1]:].tolist()
        # Self-check: the cached decode agrees with one teacher-forced forward pass.
        with torch.no_grad():
            forced = model(gen.sequences[:, :-1]).logits[0, ids.shape[1] - 1:]
        drift = float((forced - torch.stack([x[0] for x in gen.logits])).abs().max())
        assert drift < 1e-3, f"generate() logits differ from a plain forward by {drift}"
        gaps = []
        for step in gen.logits:
            top2 = torch.topk(step[0].float(), 2).values
            gaps.append(float(top2[0] - top2[1]))
        top = torch.topk(first.float(), 20)
        runs.append({"prompt_ids": c["ids"], "greedy_ids": new,
                     "greedy_text": tok.decode(new, skip_special_tokens=False),
                     "top2_logit_gap": gaps,
                     "prompt_last_top20": {"ids": top.indices.tolist(), "logits": top.values.tolist()}})
    (d / "greedy_golden.json").write_text(json.dumps(
        {"source": f"transformers {__import__('transformers').__version__} LlamaForCausalLM from "
                   f"{fname} (gguf_file=, dequantized to float32), eager attention, greedy, "
                   "eos not stopping (eos_token_id=None)",
         "max_new_tokens": 32, "runs": runs}, indent=1, ensure_ascii=False))
    print(f"wrote {d}")


def write_smollm2_greedy32(out: Path, model_path: Path, steps: int = 16) -> None:
    """32 chat-templated prompts, `steps` greedy tokens each (issue 26's quantized must-hold)."""
    d = out / "smollm2"
    prompts = (d / "greedy32_prompts.txt").read_text().splitlines()
    model_dir, fname = str(model_path.parent), model_path.name
    tok, _ = smollm2_tokenizer(model_dir, fname)
    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=fname, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    runs = []
    for text in prompts:
        chat = tok.apply_chat_template([{"role": "user", "content": text}],
                                       add_generation_prompt=True, tokenize=False)
        ids = torch.tensor([tok(chat, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,
                                 do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=tok.eos_token_id,
                                 eos_token_id=None)
        new = gen.sequences[0, ids.shape[1]:].tolist()
        lp = torch.log_softmax(torch.stack([x[0] for x in gen.logits]).double(), dim=-1)
        top2 = torch.topk(lp, 2, dim=-1).values
        runs.append({"prompt_ids": ids[0].tolist(), "greedy_ids": new,
                     "logprobs": [round(float(lp[i, t]), 6) for i, t in enumerate(new)],
                     "top2_logit_gap": [round(float(g), 6) for g in top2[:, 0] - top2[:, 1]]})
    (d / "greedy32_golden.json").write_text(json.dumps(
        {"source": f"transformers {__import__('transformers').__version__}, torch "
                   f"{torch.__version__}: LlamaForCausalLM from {fname} (gguf_file=, dequantized "
                   "to float32), eager attention, greedy, eos not stopping; prompts "
                   "greedy32_prompts.txt as one user message through the file's chat template",
         "max_new_tokens": steps, "runs": runs}, separators=(",", ":")))
    print(f"wrote {d / 'greedy32_golden.json'}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures")
    ap.add_argument("--model", default="checkpoints/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--only", choices=["tiny", "families", "gguf", "smollm2",
                                                "smollm2_greedy32"], default=None)
    a = ap.parse_args()
    out = Path(a.out)
    torch.set_num_threads(2)
    if a.only in (None, "tiny"):
        write_tiny_hf(out)
    if a.only in (None, "families"):
        write_tiny_families(out)
    if a.only in (None, "gguf"):
        write_tiny_gguf(out)
    if a.only in (None, "smollm2"):
        write_smollm2(out, Path(a.model))
    if a.only in (None, "smollm2_greedy32"):
        write_smollm2_greedy32(out, Path(a.model))


if __name__ == "__main__":
    main()
