"""Choosing each next token: the sampler, structured-output grammars and the UTF-8 guard."""
