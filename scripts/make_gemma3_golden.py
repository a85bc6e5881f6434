"""Write tests/fixtures/gemma3/greedy_golden.json: HF transformers' greedy tokens of
Gemma 3 270M on the weights of checkpoints/gemma-3-270m-q4_k_m.gguf, dequantized.

Runs in the fixture venv (Python 3.11, torch, transformers, gguf; scripts/make_fixtures.sh
builds it) and imports nothing from jaxserve: the GGUF tensors are dequantized with the
`gguf` package to float32, renamed to transformers' Gemma3ForCausalLM names (the GGUF's
norm weights hold Gemma's 1 + w: 1 is subtracted back), and the model runs in float32
with eager attention on CPU. The prompt ids come from transformers' own tokenizer read
from the GGUF (`gguf_file=`); they are written to the fixture, so the test feeds the
same ids (BOS included).

Usage: checkpoints/fixture_venv/bin/python scripts/make_gemma3_golden.py
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

ROOT = Path(__file__).resolve().parents[1]
GGUF_PATH = ROOT / "checkpoints" / "gemma-3-270m-q4_k_m.gguf"
OUT = ROOT / "tests" / "fixtures" / "gemma3" / "greedy_golden.json"
SHORT = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of",
         "Once upon a time, in a small village,"]
NEW_SHORT, NEW_LONG = 12, 8

# A varied text longer than the 512-token window (no word repeated over and over).
LONG = " ".join([
    "The history of the bicycle begins in the early nineteenth century, when inventors in",
    "Germany and France experimented with two-wheeled machines pushed along by the rider's feet.",
    "Karl Drais built his running machine in 1817; it had no pedals, a wooden frame and iron",
    "tyres, and riders used it on the smooth paths of parks and gardens. Decades later,",
    "blacksmiths and carriage makers attached cranks to the front wheel, and the velocipede",
    "became a fashion in Paris. Its front wheel grew larger to go faster, which produced the",
    "penny-farthing, a tall and dangerous machine favoured by athletic young men. In 1885 John",
    "Kemp Starley introduced the safety bicycle, with two wheels of equal size and a chain",
    "driving the rear wheel. Pneumatic tyres, patented by John Boyd Dunlop in 1888, made the",
    "ride far more comfortable. Within a few years millions of people, including many women,",
    "rode bicycles to work, to school and into the countryside. The bicycle changed clothing,",
    "since long skirts were impractical, and it gave ordinary workers a cheap way to travel.",
    "Engineers who learned their trade in bicycle workshops went on to build cars and",
    "aeroplanes: the Wright brothers repaired and sold bicycles in Dayton, Ohio, before their",
    "flights at Kitty Hawk in 1903. During the twentieth century the bicycle faded in North",
    "America as cars spread, yet it remained the main vehicle of hundreds of millions of",
    "people in China, India and the Netherlands. Racing also flourished: the Tour de France",
    "started in 1903 as a way to sell newspapers, and riders climbed the Alps and the",
    "Pyrenees on heavy steel frames with few gears. Later, derailleurs, aluminium and carbon",
    "fibre made bicycles lighter and more efficient. Mountain bikes appeared in California",
    "in the 1970s, when enthusiasts modified old cruisers to descend steep fire roads.",
    "Today cities from Copenhagen to Bogota build protected lanes, bike-sharing schemes put",
    "thousands of rental bicycles on the streets, and electric motors help commuters climb",
    "hills without arriving at work covered in sweat. Economists point out that cycling",
    "reduces traffic congestion, air pollution and the costs of public health, while",
    "planners argue about helmets, parking, and how to share the road with buses and trucks.",
    "Museums collect early machines, and restorers rebuild old frames for collectors who",
    "ride them in vintage events dressed in period costume. Children still learn to balance",
    "on small wheels in parks, often with a parent running alongside and holding the saddle.",
    "Mechanics teach repair classes in community workshops, where volunteers fix donated",
    "bicycles and give them to refugees, students and people who cannot afford a car.",
    "Meanwhile, designers experiment with folding frames for trains, cargo bikes that carry",
    "groceries or children, and recumbent machines that set speed records on flat deserts.",
    "Long-distance tourers cross continents with tents and stoves strapped to racks, and",
    "write books about the kindness of strangers met along the way. Some historians say",
    "that the bicycle was the most efficient machine ever invented for turning human energy",
    "into motion. Whatever its future, the simple pair of wheels has already shaped the way",
    "cities grow, the way people dress, and the way they imagine freedom. In the next",
    "chapter we look at how the first factories organised the production of frames,",
    "wheels and chains, and why the price of a new bicycle fell so quickly after",
])


def hf_state_dict(reader: gguf.GGUFReader, n_layers: int) -> dict[str, torch.Tensor]:
    """GGUF tensors -> Gemma3ForCausalLM names, float32, HF [out, in] layout."""
    t = {x.name: x for x in reader.tensors}

    def get(name: str, norm: bool = False) -> torch.Tensor:
        x = t[name]
        a = gguf.quants.dequantize(x.data, x.tensor_type).astype(np.float32)
        a = a.reshape(tuple(int(v) for v in reversed(x.shape.tolist())))
        return torch.from_numpy(a - 1.0 if norm else a.copy())

    sd = {"model.embed_tokens.weight": get("token_embd.weight"),
          "model.norm.weight": get("output_norm.weight", norm=True)}
    names = {"input_layernorm": ("attn_norm", True), "self_attn.q_proj": ("attn_q", False),
             "self_attn.k_proj": ("attn_k", False), "self_attn.v_proj": ("attn_v", False),
             "self_attn.o_proj": ("attn_output", False),
             "self_attn.q_norm": ("attn_q_norm", True), "self_attn.k_norm": ("attn_k_norm", True),
             "post_attention_layernorm": ("post_attention_norm", True),
             "pre_feedforward_layernorm": ("ffn_norm", True),
             "post_feedforward_layernorm": ("post_ffw_norm", True),
             "mlp.gate_proj": ("ffn_gate", False), "mlp.up_proj": ("ffn_up", False),
             "mlp.down_proj": ("ffn_down", False)}
    for i in range(n_layers):
        for hf, (gg, norm) in names.items():
            sd[f"model.layers.{i}.{hf}.weight"] = get(f"blk.{i}.{gg}.weight", norm)
    return sd


def main() -> None:
    reader = gguf.GGUFReader(GGUF_PATH)
    f = {k: v.contents() for k, v in reader.fields.items()
         if not k.startswith("tokenizer.ggml.")}
    n_layers = f["gemma3.block_count"]
    cfg = Gemma3TextConfig(
        vocab_size=262144, hidden_size=f["gemma3.embedding_length"],
        intermediate_size=f["gemma3.feed_forward_length"], num_hidden_layers=n_layers,
        num_attention_heads=f["gemma3.attention.head_count"],
        num_key_value_heads=f["gemma3.attention.head_count_kv"],
        head_dim=f["gemma3.attention.key_length"],
        max_position_embeddings=f["gemma3.context_length"],
        rms_norm_eps=f["gemma3.attention.layer_norm_rms_epsilon"],
        rope_theta=f["gemma3.rope.freq_base"], rope_local_base_freq=10000.0,
        sliding_window=f["gemma3.attention.sliding_window"], query_pre_attn_scalar=256,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
        final_logit_softcapping=None, attn_logit_softcapping=None,
        bos_token_id=2, eos_token_id=[1, 106], pad_token_id=0)
    cfg._attn_implementation = "eager"
    model = Gemma3ForCausalLM(cfg).eval()
    missing, unexpected = model.load_state_dict(hf_state_dict(reader, n_layers), strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    model.tie_weights()
    tok = AutoTokenizer.from_pretrained(str(GGUF_PATH.parent), gguf_file=GGUF_PATH.name)
    cases = []
    for text, new in [(p, NEW_SHORT) for p in SHORT] + [(LONG, NEW_LONG)]:
        ids = tok(text, add_special_tokens=True)["input_ids"]
        assert ids[0] == 2, ids[:3]
        t0 = time.time()
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True,
                                 eos_token_id=None, pad_token_id=0)
        gen = out.sequences[0, len(ids):].tolist()
        gaps = [float(torch.topk(s[0], 2).values.diff().abs()) for s in out.scores]
        print(f"{len(ids)} prompt tokens -> {gen} ({time.time() - t0:.1f} s), min gap "
              f"{min(gaps):.3f}: {tok.decode(gen)!r}")
        cases.append({"text": text, "prompt_ids": ids, "greedy": gen, "top2_gap": gaps})
    OUT.write_text(json.dumps({
        "source": "scripts/make_gemma3_golden.py: transformers Gemma3ForCausalLM, float32, eager "
                  "attention, CPU, on the dequantized gemma-3-270m-q4_k_m.gguf",
        "transformers": __import__("transformers").__version__, "cases": cases}, indent=1))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
