"""Write tests/fixtures/smollm2/continue_final_golden.json (run by scripts/make_fixtures.sh).

transformers' own chat-template rendering with `continue_final_message=True`
(`render_jinja_template`, the function its `apply_chat_template` calls) for the
default model's template, read from the SmolLM2 GGUF by the `gguf` library
(transformers' GGUF tokenizer loader needs torch), so the
server's /tokenize and chat rendering are checked against an independent
implementation. Tokenizer-side templating needs only transformers + jinja2 (no
torch); imports nothing from jaxserve.

Usage: python scripts/make_chat_template_golden.py --out tests/fixtures --model GGUF
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import gguf
from transformers.utils.chat_template_utils import render_jinja_template

# Final assistant contents that stress the cut: trailing space / newline, empty,
# a text that also occurs inside the end-of-turn marker ("end" in "<|im_end|>"),
# a text repeated earlier in the conversation, and multi-byte characters.
FINALS = ["Sure, the answer is", "Hello ", "Line one\n", "", "end", "hi", "im_", "Tokyo: 東京 🙂 "]


def cases() -> list[list[dict[str, str]]]:
    """Conversations whose final message is an assistant turn to continue."""
    out = []
    for final in FINALS:
        out.append([{"role": "user", "content": "hi"}, {"role": "assistant", "content": final}])
    out.append([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say end"},
                {"role": "assistant", "content": "end"}])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", type=Path, required=True)
    args = ap.parse_args()
    field = gguf.GGUFReader(args.model).fields["tokenizer.chat_template"]
    template = bytes(field.parts[field.data[0]]).decode("utf-8")
    rows = []
    for messages in cases():
        rendered, _ = render_jinja_template([messages], chat_template=template,
                                            add_generation_prompt=False,
                                            continue_final_message=True)
        text = rendered[0]
        rows.append({"messages": messages, "text": text})
    d = args.out / "smollm2"
    d.mkdir(parents=True, exist_ok=True)
    (d / "continue_final_golden.json").write_text(json.dumps(
        {"reference": "transformers.utils.chat_template_utils.render_jinja_template("
                      "continue_final_message=True) of the GGUF's tokenizer.chat_template",
         "cases": rows}, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
