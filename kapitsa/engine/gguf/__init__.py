"""GGUF files: the reader, their config and tensor names mapped to Hugging Face ones, the quant formats, the embedded tokenizer."""
