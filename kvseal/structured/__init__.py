"""Structured output: JSON (any object, or a JSON Schema) enforced while sampling, with xgrammar.

`schema.check_schema` validates a schema at the door (400 naming the problem);
`compiler.GrammarCompilerPool` compiles grammars off the engine loop, cached per tenant;
`matching` applies a request's token mask to its logits row and advances its matcher.
"""
