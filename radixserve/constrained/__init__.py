"""Constrained decoding: grammars (JSON schema, regex, EBNF) that decide which tokens may come next."""
