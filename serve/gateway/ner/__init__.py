"""`/v1/ner`: token classification (named entities) by a Triton entry, aggregated as transformers' pipeline does."""
