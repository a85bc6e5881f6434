"""Write the PEFT LoRA golden fixture under tests/fixtures/smollm2_lora/ (issue 27).

Runs in the fixture venv (checkpoints/fixture_venv: torch, transformers, peft), like
scripts/make_golden.py, and imports nothing from jaxserve: the adapter and its greedy
tokens come from an independent implementation (HF transformers + peft).

SmolLM2-135M-Instruct is the default Q4_1 GGUF dequantized to float32 by transformers
(gguf_file=...). A rank-4 LoRA on q_proj and v_proj (lora_alpha 8) is made by peft
with random A and B (init_lora_weights=False) and then trained a few Adam steps on one
sentence, so B is non-zero and the greedy output differs from the base model's.

Writes (about 0.93 MB in all):
  adapter_config.json, adapter_model.safetensors   (peft's save_pretrained)
  greedy.json   prompt ids (greedy_golden.json's first chat), 16 greedy tokens of
                HF+peft and of the base model, with each step's top-2 logit gap.

Usage: checkpoints/fixture_venv/bin/python scripts/make_lora_fixture.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

STEPS = 16


def greedy(model, ids: torch.Tensor) -> tuple[list[int], list[float]]:
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=2, eos_token_id=None)
    gaps = [float(torch.topk(s[0].float(), 2).values.diff().abs()[0]) for s in gen.logits]
    return gen.sequences[0, ids.shape[1]:].tolist(), gaps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="checkpoints/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--out", default="tests/fixtures/smollm2_lora")
    a = ap.parse_args()
    path, out = Path(a.model), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    golden = json.loads(Path("tests/fixtures/smollm2/greedy_golden.json").read_text())
    prompt = golden["runs"][0]["prompt_ids"]
    ids = torch.tensor([prompt])
    base_ids, base_gaps = greedy(model, ids)

    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                     bias="none", init_lora_weights=False, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, cfg)
    text = "The capital of France is Paris. Paris is a city of light and of art."
    batch = torch.tensor([tok(text)["input_ids"]])
    opt = torch.optim.Adam([p for p in peft_model.parameters() if p.requires_grad], lr=3e-3)
    peft_model.train()
    for _ in range(8):
        loss = peft_model(batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    peft_model.eval()
    lora_ids, lora_gaps = greedy(peft_model, ids)
    assert lora_ids != base_ids, "the adapter does not change the greedy output"
    peft_model.save_pretrained(str(out))  # adapter_config.json + adapter_model.safetensors
    (out / "README.md").unlink(missing_ok=True)  # peft's model card template
    import peft
    import transformers

    (out / "greedy.json").write_text(json.dumps({
        "source": f"transformers {transformers.__version__} + peft {peft.__version__}, "
                  f"{path.name} (gguf_file=, dequantized to float32), eager attention, greedy, "
                  f"eos not stopping; adapter: LoraConfig(r=4, lora_alpha=8, q_proj+v_proj, "
                  f"init_lora_weights=False) + 8 Adam steps (lr 3e-3) on one sentence",
        "prompt_ids": prompt, "lora_greedy_ids": lora_ids, "lora_top2_logit_gap": lora_gaps,
        "base_greedy_ids": base_ids, "base_top2_logit_gap": base_gaps,
        "final_train_loss": float(loss)}, indent=1))
    print(f"wrote {out}: lora {lora_ids}\nbase {base_ids}")


if __name__ == "__main__":
    main()
