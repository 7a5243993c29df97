"""Plain curation code: the embedded corpus, datatrove pipelines, tokenizer and mixtures."""
