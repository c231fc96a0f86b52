"""SpecGUI app entry point: `python app.py` serves the page on http://127.0.0.1:7860.

Minimal page until the full visualisation lands: pick a method, type a prompt, watch tokens stream.
"""

from __future__ import annotations

import gradio as gr

from specgui import decode, methods
from specgui.errors import SpecGUIError
from specgui.events import Prefill, Step, Summary
from specgui.loading import load
from specgui.text import encode_prompt

LM = None


def model():
    global LM
    if LM is None:
        LM = load()
    return LM


def run(prompt: str, method: str, max_new_tokens: float):
    try:
        lm = model()
        ids = encode_prompt(lm.tokenizer, prompt)
        text = ""
        for event in decode.generate(lm, ids, method, max_new_tokens=int(max_new_tokens), prompt_text=prompt):
            if isinstance(event, Prefill):
                text += event.piece
            elif isinstance(event, Step):
                text += "".join(event.emitted_pieces)
            elif isinstance(event, Summary):
                yield event.text, (f"{event.new_tokens} tokens, {event.tokens_per_s:.1f} tok/s, "
                                   f"tau {event.tau:.2f}, stop: {event.stop}")
                return
            yield text, ""
    except SpecGUIError as exc:
        yield "", f"error: {exc}"


def build() -> gr.Blocks:
    with gr.Blocks(title="SpecGUI") as demo:
        gr.Markdown("# SpecGUI\nSelf-speculative decoding, step by step.")
        prompt = gr.Textbox(label="Prompt", value="Write a haiku about speculative decoding.")
        with gr.Row():
            method = gr.Dropdown(methods.names(), value="pld", label="Method")
            max_new = gr.Slider(1, 512, value=128, step=1, label="Max new tokens")
        go = gr.Button("Run", variant="primary")
        output = gr.Textbox(label="Output", lines=8)
        summary = gr.Markdown()
        go.click(run, [prompt, method, max_new], [output, summary], api_name="generate")
    return demo


if __name__ == "__main__":
    model()
    build().queue().launch()
