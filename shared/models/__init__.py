"""Models: which exist and where (catalog), their text side (text: tokenizer, chat template,
detokenizer; no torch), and their weights for the engine (weights: torch, imported explicitly)."""
