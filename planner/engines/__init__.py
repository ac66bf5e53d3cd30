"""The engines as data: what each released vLLM and SGLang version accepts and wires, their memory accounting,
and the nearest plan each expresses."""
