"""Fractal-LLM: int8-compressed copies of the model spliced in mid-forward to refine draft slots."""
