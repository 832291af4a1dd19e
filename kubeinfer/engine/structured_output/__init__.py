"""Structured output: decoding constrained to a JSON Schema, any JSON object, a regex, a choice of strings
or a grammar, with llguidance as the grammar engine (also one of vLLM's backends).

Chosen by measurement on the schema set in kubeinfer/dev/testing/json_schemas.py (12 schemas: nested
objects, bounded arrays, enums, ranges, optional fields, patterns, formats, anyOf, $defs), on this
2-core CPU with an 8,192-token BPE vocabulary (`python benchmarks/bench_structured_output.py`):

    library      compile p50 / p99    mask per step, walking a document    schemas compiled
                                      batch 1       batch 32
    llguidance   0.26 / 0.70 ms       31 us         2.0 ms                 12 / 12
    xgrammar     1.21 / 5.97 ms       642 us        6.2 ms                 12 / 12

(xgrammar precomputes masks per grammar state and is faster at the very first state, 1 vs 5 us, but
slower once a document is under way; outlines-core builds a full token index per regex, minutes for
large vocabularies.) llguidance also needs nothing at run time beyond its own wheel.

`grammar.GrammarCompiler` turns a request's StructuredOutputsParams into a matcher per sequence (the
compiled grammar cached by spec); the matcher rides on the Sequence, the sampler asks it for the
allowed-token bitmask, and the engine feeds it each accepted token.
"""
