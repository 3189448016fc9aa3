"""What is true of SGLang: flags by version, log parsing, failure classes, the memory model, the HTTP client.

Every fact here cites its section of ``shared/sglang-reference.md`` (``§n.m``).
"""
