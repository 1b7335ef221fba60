"""Draft sources for speculative decoding: what proposes the tokens a checked step checks (base.py
has the contract; prompt_lookup.py the source that needs no weights)."""
