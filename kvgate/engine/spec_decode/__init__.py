"""Speculative decoding: proposers that guess a request's next tokens from text it has
already seen (n-gram prompt lookup, suffix tries over its prompt, output and its tenant's
earlier replies), and the verification that keeps only what the model itself would sample.
Below kvgate.engine.core: it reads requests through protocols and imports no scheduler."""
