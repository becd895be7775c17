"""Processing: image and video processors, the tokenizer builder and the processor (thin for now)."""
