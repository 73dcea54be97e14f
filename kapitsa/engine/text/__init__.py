"""Text in and out: tokenizers, detokenizing, chat templates, prompt preparation and token-id checks."""
