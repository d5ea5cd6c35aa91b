"""Structured output: grammars that constrain what a request may generate.

- `spec.py`: `GrammarSpec`, the typed description a request carries (JSON Schema, any JSON object,
  regular expression, Lark grammar; optionally armed only after a trigger such as `</think>`), and
  its translation into the grammar text llguidance compiles. torch-free.
- `compiler.py`: `GrammarCompiler`, one per tokenizer: validates specs (the frontend turns its
  errors into 400s) and compiles them once per distinct grammar text (an LRU cache of matchers
  that each request deep-copies).
- `state.py`: `GrammarState`, one request's position in its grammar: fills its row of the token
  bitmask, accepts sampled tokens, rolls back, says when the grammar is complete or broken.

The sampler applies the bitmask (`strata.layers.sampler.apply_token_bitmask`); nothing here imports
torch, so the HTTP frontend validates grammars without it. llguidance is imported only by
`compiler.py` and `state.py`.
"""
