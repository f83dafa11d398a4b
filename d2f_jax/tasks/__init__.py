"""Built-in tasks: a deterministic GSM8K-style arithmetic task and its small tokenizer."""
