"""Structured output by constrained decoding, in plain Python (no torch, no grammar library).

``schema`` compiles a JSON Schema subset into nodes; ``automaton`` reads a document's UTF-8 bytes against them as a
pushdown automaton whose state is a set of stack configurations (``anyOf`` branches followed at once); ``grammar``
names and caches compiled grammars (``json_schema_grammar``, ``json_object_grammar``, ``choice_grammar``,
``regex_grammar``); ``regex_syntax`` parses a regex subset and ``regex`` compiles it to a byte-level NFA read as a lazy
DFA (``guided_regex``, and ``pattern`` inside JSON strings);
``vocab`` gives each token's exact bytes and ``masks`` turns an automaton state into the vocabulary mask the sampler
applies (a byte trie walked with the automaton, the plain-string part precomputed, masks cached by state), with the
per-request ``Guide`` that the engine advances token by token.
"""
